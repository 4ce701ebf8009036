"""A single-node Kubernetes inside a private mount+network namespace, for the cluster tier.

Run by tests/cluster/cluster.py as ``python launcher.py SETTINGS.json`` (root). It binds the
host-side API port first (127.0.0.1, an ephemeral port), then unshares a mount and a network
namespace, so everything it starts (etcd, the control plane, containerd, the kubelet, the pods)
lives where only this process tree sees it: tmpfs over /run, /var/lib, /var/log and /tmp, a
private loopback with the node address, a DNAT for the ``kubernetes`` Service IP. The API
server is reached from the host only through the port bound before the unshare: each connection
is copied to the API server inside. Every process it starts runs in a cgroup of its own (in
every v1 hierarchy), which is the kubelet's cgroupRoot too, so teardown kills exactly that tree
and removes the cgroups; the namespaces and their mounts go with the last process.

Files (under the work dir, host-visible): ``port`` (the API port), ``ready`` (written once the
node is Ready), ``pki/``, ``admin.kubeconfig`` (for the host side), ``logs/<daemon>.log``,
``control`` (a FIFO: ``restart kubelet`` restarts the kubelet). SIGTERM tears down.
Only the standard library: the launcher runs before anything else is set up.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MS_BIND, MS_REC = 4096, 16384
NODE_IP = "10.99.0.1"
SERVICE_RANGE = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"
POD_SUBNET = "10.88.0.0/16"
API_PORT = 6443
TMPFS = ("/run", "/var/lib", "/var/log", "/tmp")
SANDBOX_IMAGE = "registry.k8s.io/pause:3.10"

libc = ctypes.CDLL(None, use_errno=True)


def log(msg: str) -> None:
    print(f"[launcher {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, **kw: Any) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def covered_by(paths: list[Path], tmpfs: tuple[str, ...]) -> list[Path]:
    """The topmost of ``paths`` (resolved) that lie under one of the ``tmpfs`` mount points,
    so would be hidden by it. A path that is such a mount point itself cannot be kept."""
    under: set[Path] = set()
    for p in (q.resolve() for q in paths):
        for d in map(Path, tmpfs):
            if p == d:
                raise RuntimeError(f"{p} is where the tier mounts a tmpfs: move it elsewhere")
            if p.is_relative_to(d):
                under.add(p)
    return sorted(p for p in under if not any(p != q and p.is_relative_to(q) for q in under))


class Launcher:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.s = settings
        self.work = Path(settings["workdir"])
        self.bin = Path(settings["bin"])
        self.node = settings["node_name"]
        self.cgroup = settings["cgroup"]
        self.pki = self.work / "pki"
        self.logs = self.work / "logs"
        self.etc = Path("/run/k8s")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = threading.Event()
        self.env = dict(os.environ, PATH=f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}")

    # -- namespace, cgroups ---------------------------------------------------------------

    def kept_paths(self) -> list[Path]:
        """What the tier runs from: the checkout (its build/ holds the binaries, images, work
        dir), the Python running us, and each path the settings name."""
        paths = [Path(__file__).resolve().parents[2], Path(sys.prefix), Path(sys.executable)]
        paths += [self.work, self.bin, Path(self.s["toolkit_cdi_dir"]), Path(self.s["runtime"])]
        paths += [Path(t) for t in self.s["images"]]
        return paths

    def enter_namespace(self) -> None:
        if libc.unshare(CLONE_NEWNS | CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS|CLONE_NEWNET)")
        run("mount", "--make-rprivate", "/")
        # A checkout under /tmp (a CI's fresh clone) would vanish under the tmpfs: hold each
        # such path open first and bind it back onto the tmpfs at its own path.
        keep = covered_by(self.kept_paths(), TMPFS)
        held = {p: (os.open(p, os.O_PATH), p.is_dir()) for p in keep}
        for d in TMPFS:
            run("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", d)
        os.chmod("/tmp", 0o1777)
        for path, (fd, is_dir) in held.items():
            if is_dir:
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            source = f"/proc/self/fd/{fd}".encode()
            if libc.mount(source, str(path).encode(), None, MS_BIND | MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"bind {path} back over the tmpfs")
            os.close(fd)
        run("ip", "link", "set", "lo", "up")
        run("ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        for chain in ("PREROUTING", "OUTPUT"):
            run(
                "iptables",
                "-t",
                "nat",
                "-A",
                chain,
                "-d",
                f"{SERVICE_IP}/32",
                "-p",
                "tcp",
                "--dport",
                "443",
                "-j",
                "DNAT",
                "--to-destination",
                f"{NODE_IP}:{API_PORT}",
            )

    def hierarchies(self) -> list[Path]:
        found = []
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, mountpoint, fstype, *_ = line.split()
            if fstype == "cgroup":
                found.append(Path(mountpoint))
        return found

    def enter_cgroup(self) -> None:
        for h in self.hierarchies():
            mine = h / self.cgroup
            mine.mkdir(exist_ok=True)
            if (h / "cpuset.cpus").exists():
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (mine / f).write_text((h / f).read_text())
            (mine / "cgroup.procs").write_text(str(os.getpid()))

    # -- PKI and configs ------------------------------------------------------------------

    def cert(self, name: str, subject: str, sans: str = "", server: bool = False) -> None:
        key, csr, crt = (self.pki / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        run("openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
        run("openssl", "req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
        ext = self.pki / f"{name}.ext"
        usage = "serverAuth" if server else "clientAuth"
        ext.write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={usage}\n" + (f"subjectAltName={sans}\n" if sans else "")
        )
        run(
            "openssl",
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(self.pki / "ca.crt"),
            "-CAkey",
            str(self.pki / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(ext),
            "-out",
            str(crt),
        )

    def make_pki(self) -> None:
        self.pki.mkdir(parents=True, exist_ok=True)
        ca_key, ca = self.pki / "ca.key", self.pki / "ca.crt"
        run("openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(ca_key))
        run(
            "openssl",
            "req",
            "-x509",
            "-new",
            "-key",
            str(ca_key),
            "-subj",
            "/CN=vgpu-test-ca",
            "-days",
            "2",
            "-out",
            str(ca),
        )
        sans = (
            f"IP:{NODE_IP},IP:{SERVICE_IP},IP:127.0.0.1,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:localhost"
        )
        self.cert("apiserver", "/CN=kube-apiserver", sans, server=True)
        self.cert("admin", "/O=system:masters/CN=admin")
        self.cert("node", f"/O=system:nodes/CN=system:node:{self.node}")
        run(
            "openssl",
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            str(self.pki / "sa.key"),
        )
        run(
            "openssl",
            "ec",
            "-in",
            str(self.pki / "sa.key"),
            "-pubout",
            "-out",
            str(self.pki / "sa.pub"),
        )
        for name, user, server in (
            ("admin", "admin", f"https://{NODE_IP}:{API_PORT}"),
            ("node", "node", f"https://{NODE_IP}:{API_PORT}"),
            ("host", "admin", f"https://127.0.0.1:{self.s['port']}"),
        ):
            (self.work / f"{name}.kubeconfig").write_text(
                json.dumps(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "current-context": "c",
                        "clusters": [
                            {
                                "name": "c",
                                "cluster": {"server": server, "certificate-authority": str(ca)},
                            }
                        ],
                        "users": [
                            {
                                "name": "u",
                                "user": {
                                    "client-certificate": str(self.pki / f"{user}.crt"),
                                    "client-key": str(self.pki / f"{user}.key"),
                                },
                            }
                        ],
                        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    }
                )
            )
        (self.work / "host.kubeconfig").chmod(0o600)

    def write_configs(self) -> None:
        self.etc.mkdir(parents=True, exist_ok=True)
        cni = Path("/run/cni/net.d")
        cni.mkdir(parents=True)
        (cni / "10-bridge.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "vgpu-test",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": "cni0",
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_SUBNET}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                            },
                        }
                    ],
                }
            )
        )
        cdi_dirs = [self.s["toolkit_cdi_dir"], "/var/run/cdi"]
        (self.etc / "containerd.toml").write_text(f"""version = 3
root = '/var/lib/containerd'
state = '/run/containerd'
[grpc]
  address = '/run/containerd/containerd.sock'
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{SANDBOX_IMAGE}'
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = {json.dumps(cdi_dirs)}
  restrict_oom_score_adj = true
  disable_apparmor = true
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{self.s["runtime"]}'
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['/usr/lib/cni']
  conf_dir = '/run/cni/net.d'
""")
        (self.etc / "kubelet.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": False},
                        "x509": {"clientCAFile": str(self.pki / "ca.crt")},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "cgroupDriver": "cgroupfs",
                    "cgroupRoot": "/" + self.cgroup,
                    "failCgroupV1": False,
                    "failSwapOn": False,
                    "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
                    "evictionHard": {
                        "memory.available": "1Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "localStorageCapacityIsolation": False,
                    "resolvConf": "",
                    "serializeImagePulls": False,
                    "nodeStatusUpdateFrequency": "5s",
                    "syncFrequency": "10s",
                    "fileCheckFrequency": "5s",
                    "address": NODE_IP,
                    "healthzBindAddress": "127.0.0.1",
                }
            )
        )

    # -- daemons --------------------------------------------------------------------------

    def start(self, name: str, *cmd: str) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        out = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        out.close()

    def alive(self, name: str) -> None:
        if self.procs[name].poll() is not None:
            tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited ({self.procs[name].returncode}):\n{tail}")

    def wait(self, what: str, check: Any, timeout: float, *names: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for n in names:
                self.alive(n)
            try:
                if check():
                    return
            except (OSError, ssl.SSLError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.5)

    def api_get(self, path: str) -> tuple[int, bytes]:
        import http.client

        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        conn = http.client.HTTPSConnection(NODE_IP, API_PORT, context=ctx, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def node_ready(self) -> bool:
        status, body = self.api_get(f"/api/v1/nodes/{self.node}")
        if status != 200:
            return False
        conds = json.loads(body).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def start_kubelet(self) -> None:
        self.start(
            "kubelet",
            str(self.bin / "kubelet"),
            f"--config={self.etc / 'kubelet.yaml'}",
            f"--kubeconfig={self.work / 'node.kubeconfig'}",
            f"--hostname-override={self.node}",
            f"--node-ip={NODE_IP}",
            "--node-labels=nvidia.com/gpu.present=true",
            "--v=2",
        )

    def bring_up(self) -> None:
        t0 = time.monotonic()
        pki, b = self.pki, self.bin
        self.start(
            "etcd",
            "etcd",
            "--data-dir=/var/lib/etcd",
            "--listen-client-urls=http://127.0.0.1:2379",
            "--advertise-client-urls=http://127.0.0.1:2379",
            "--listen-peer-urls=http://127.0.0.1:2380",
        )
        self.start(
            "kube-apiserver",
            str(b / "kube-apiserver"),
            "--etcd-servers=http://127.0.0.1:2379",
            f"--advertise-address={NODE_IP}",
            f"--secure-port={API_PORT}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            f"--kubelet-client-certificate={pki / 'admin.crt'}",
            f"--kubelet-client-key={pki / 'admin.key'}",
            "--kubelet-preferred-address-types=InternalIP",
        )
        # containerd and the images meanwhile: the API server takes 20-40 s on 2 cores.
        self.start("containerd", str(b / "containerd"), f"--config={self.etc / 'containerd.toml'}")
        sock = Path("/run/containerd/containerd.sock")
        self.wait("containerd's socket", sock.exists, 60, "containerd")
        for image in self.s["images"]:
            run(
                str(b / "ctr"),
                "--address",
                str(sock),
                "-n",
                "k8s.io",
                "images",
                "import",
                "--no-unpack=false",
                image,
                env=self.env,
            )
        log(f"images imported at {time.monotonic() - t0:.1f}s")
        self.wait(
            "the API server",
            lambda: self.api_get("/readyz")[0] == 200,
            180,
            "etcd",
            "kube-apiserver",
        )
        log(f"API server ready at {time.monotonic() - t0:.1f}s")
        admin = str(self.work / "admin.kubeconfig")
        self.start(
            "kube-controller-manager",
            str(b / "kube-controller-manager"),
            f"--kubeconfig={admin}",
            "--leader-elect=false",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=true",
            "--bind-address=127.0.0.1",
        )
        self.start(
            "kube-scheduler",
            str(b / "kube-scheduler"),
            f"--kubeconfig={admin}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
        )
        self.start_kubelet()
        self.wait("the node to be Ready", self.node_ready, 120, "kubelet", "containerd")
        log(f"node Ready at {time.monotonic() - t0:.1f}s")

    # -- host-side access -----------------------------------------------------------------

    def forward(self, listener: socket.socket) -> None:
        listener.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self.pipe, args=(client,), daemon=True).start()

    @staticmethod
    def pipe(client: socket.socket) -> None:
        try:
            upstream = socket.create_connection((NODE_IP, API_PORT), timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        client.settimeout(None)
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        try:
            while True:
                for key, _ in sel.select():
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def control(self) -> None:
        fifo = self.work / "control"
        while not self.stopping.is_set():
            with open(fifo) as f:  # blocks until the host side writes a command
                for line in f:
                    cmd = line.split()
                    reply = self.work / "control.reply"
                    try:
                        if cmd == ["restart", "kubelet"]:
                            self.stop_proc("kubelet")
                            self.start_kubelet()
                        elif cmd == ["stop"]:
                            os.kill(os.getpid(), signal.SIGTERM)
                        reply.write_text(f"ok {' '.join(cmd)}\n")
                    except Exception as exc:
                        reply.write_text(f"error {exc}\n")

    # -- teardown -------------------------------------------------------------------------

    def stop_proc(self, name: str, timeout: float = 20) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def cgroup_pids(self) -> set[int]:
        pids: set[int] = set()
        for h in self.hierarchies():
            top = h / self.cgroup
            if top.is_dir():
                for procs in top.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError):
                        pids.update(int(p) for p in procs.read_text().split())
        pids.discard(os.getpid())
        return pids

    def teardown(self) -> None:
        self.stopping.set()
        for name in ("kubelet", "kube-scheduler", "kube-controller-manager", "containerd"):
            self.stop_proc(name, timeout=10)
        for name in list(self.procs):
            self.stop_proc(name)
        deadline = time.monotonic() + 60
        while (left := self.cgroup_pids()) and time.monotonic() < deadline:
            for pid in left:  # shims, pause and the pods' processes: all ours, by their pids
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        for h in self.hierarchies():
            top = h / self.cgroup
            (h / "cgroup.procs").write_text(str(os.getpid()))
            if top.is_dir():
                for d in sorted(
                    (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
                ):
                    d.rmdir()
                top.rmdir()
        log("torn down")


def main() -> int:
    settings = json.loads(Path(sys.argv[1]).read_text())
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the test session gone: tear down
    # The host-side port, bound before leaving the host's network namespace.
    listener = socket.create_server(("127.0.0.1", 0))
    settings["port"] = listener.getsockname()[1]
    launcher = Launcher(settings)
    work = launcher.work
    (work / "port").write_text(str(settings["port"]))
    signal.signal(signal.SIGTERM, lambda *_: launcher.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: launcher.stopping.set())
    try:
        launcher.enter_namespace()
        launcher.enter_cgroup()
        launcher.make_pki()
        launcher.write_configs()
        os.mkfifo(work / "control")
        launcher.bring_up()
        threading.Thread(target=launcher.forward, args=(listener,), daemon=True).start()
        threading.Thread(target=launcher.control, daemon=True).start()
        (work / "ready").write_text("ready\n")
        while not launcher.stopping.wait(1):
            for name in ("etcd", "kube-apiserver", "containerd"):
                launcher.alive(name)
        return 0
    except Exception as exc:
        (work / "failed").write_text(f"{exc}\n")
        log(f"failed: {exc}")
        return 1
    finally:
        listener.close()
        launcher.teardown()


if __name__ == "__main__":
    sys.exit(main())
