"""The real `vgpu-plugin serve` process on a simulated node, driven by the kubelet emulator."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import NO_NAMESPACES

from vgpu_plugin.api.constants import HEALTHY, UNHEALTHY
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core import dra
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.sim.dra_kubelet import DraKubeletEmulator, FakeApiHttp, FakeApiServer
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, PodResourcesEmulator, short_tmp_dir
from vgpu_plugin.sim.simgpu import Node

RES = "nvidia.com/gpu"


@dataclass
class Served:
    node: Node
    kubelet: KubeletEmulator
    plugin_dir: Path
    host_root: Path
    state_dir: Path
    config: Path
    log: Path
    argv: list[str]
    podres: PodResourcesEmulator
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.node.env(), stdout=out, stderr=out)
        return self.proc

    def uuids(self) -> list[str]:
        return [g.uuid for g in self.node.gpus()]

    # The waits below end as soon as what they wait for happens: their bounds (30 s) cost a
    # green run nothing and keep a loaded host's slow plugin process from turning them red.
    def wait_for(
        self, predicate: Callable[[list[pb.Device]], bool], timeout: float = 30
    ) -> list[pb.Device]:
        return self.kubelet.wait_devices(RES, predicate, timeout)

    def logs(self) -> str:
        return self.log.read_text()

    def wait_log(self, text: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.logs():
            assert time.monotonic() < deadline, f"{text!r} not logged:\n{self.logs()}"
            time.sleep(0.05)
        return self.logs()


def install_shim(host_root: Path, native_tree: Path) -> None:
    from vgpu_plugin.node.host import install

    install.install_shim(host_root, native_tree / "lib" / "libvgpu.so")


@pytest.fixture
def served(simgpu_node: Node, native_tree: Path, tmp_path: Path) -> Iterator[Served]:
    host_root = tmp_path / "host"
    install_shim(host_root, native_tree)
    config = tmp_path / "config.yaml"
    # hostRoot from the config (no --host-root flag), as a ConfigMap-only install has it
    config.write_text(
        "version: v1\nsharing: {splitCount: 4, compute: proportional}\n"
        f"health: {{recoverySeconds: 1}}\nhostRoot: {host_root}\n"
    )
    plugin_dir = short_tmp_dir()
    log = tmp_path / "plugin.log"
    state_dir = tmp_path / "state"
    argv = [
        sys.executable, "-m", "vgpu_plugin", "serve",
        "--config", str(config), "--device-plugin-dir", str(plugin_dir),
        "--state-dir", str(state_dir),
        "--lock-dir", str(tmp_path / "locks"), "--node-name", "node-1",
        "--metrics-address", "127.0.0.1:0", "--log-level", "debug",
        "--pod-resources-socket", str(plugin_dir / "podres.sock"), "--cleanup-grace", "1",
    ]  # fmt: skip
    podres = PodResourcesEmulator(plugin_dir / "podres.sock")
    s = Served(
        simgpu_node, KubeletEmulator(plugin_dir), plugin_dir, host_root, state_dir, config, log,
        argv, podres,
    )  # fmt: skip
    s.kubelet.start()
    s.start()
    try:
        s.kubelet.wait_registrations(1, timeout=30)
        s.wait_for(lambda d: len(d) == 8)
        yield s
    finally:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        s.kubelet.stop()


def test_registers_and_advertises_the_simulated_gpus(served: Served) -> None:
    devices = served.kubelet.devices(RES)
    assert devices is not None
    a, b = served.uuids()
    assert sorted(d.ID for d in devices) == sorted(
        [f"{a}-{k}" for k in range(4)] + [f"{b}-{k}" for k in range(4)]
    )
    # NUMA node comes from NVML: the fixture puts GPU i on NUMA node i.
    assert {d.topology.nodes[0].ID for d in devices if d.ID.startswith(b)} == {1}
    assert served.kubelet.registration_count(RES) == 1
    served.wait_log("registered")


def test_sigkill_and_restart_keeps_ids_and_records(served: Served) -> None:
    a, _ = served.uuids()
    resp = served.kubelet.allocate(RES, [f"{a}-0", f"{a}-1"])
    aid = resp.container_responses[0].envs["VGPU_ALLOCATION_ID"]
    before = sorted(d.ID for d in served.kubelet.devices(RES) or [])
    assert served.proc is not None
    served.proc.kill()
    served.proc.wait()
    served.start()
    served.kubelet.wait_registrations(2, timeout=30)
    after = served.wait_for(lambda d: len(d) == 8)
    assert sorted(d.ID for d in after) == before
    records = AllocationStore(served.state_dir).all()
    assert [r.allocation_id for r in records] == [aid]
    assert (served.host_root / "limits" / aid).exists()


def test_kubelet_restarts_are_answered_once_each(served: Served) -> None:
    for i in range(3):
        served.kubelet.restart()
        served.kubelet.wait_registrations(2 + i, timeout=10)
        served.wait_for(lambda d: len(d) == 8)
    time.sleep(0.5)
    assert served.kubelet.registration_count(RES) == 4


def test_xid_makes_slices_unhealthy_until_quiet(served: Served) -> None:
    _, b = served.uuids()
    served.node.inject_xid(1, 61)  # critical, but no reset needed (79 would need one)
    served.wait_for(lambda d: {x.ID.rsplit("-", 1)[0] for x in d if x.health == UNHEALTHY} == {b})
    # recoverySeconds: 1 -> healthy again with all slices
    served.wait_for(lambda d: all(x.health == HEALTHY for x in d), timeout=30)
    served.node.inject_xid(1, 13)  # an application XID changes nothing
    time.sleep(1.5)
    assert all(x.health == HEALTHY for x in served.kubelet.devices(RES) or [])


def test_lost_gpu_is_unhealthy_and_comes_back(served: Served) -> None:
    a, _ = served.uuids()
    served.node.set_lost(0)
    served.wait_for(lambda d: {x.ID.rsplit("-", 1)[0] for x in d if x.health == UNHEALTHY} == {a})
    served.node.set_lost(0, False)
    served.wait_for(lambda d: all(x.health == HEALTHY for x in d), timeout=30)


def test_config_reload_valid_and_invalid(served: Served) -> None:
    root = f"hostRoot: {served.host_root}\n"
    served.config.write_text("version: v1\nsharing: {splitCount: 8}\n" + root)
    served.wait_for(lambda d: len(d) == 16, timeout=10)
    served.config.write_text("version: v1\nsharing: {splitCount: -3}\n" + root)
    logs = served.wait_log("sharing.splitCount")
    assert "keeping the running config" in logs
    # hostRoot cannot move under running containers: refused, said why
    served.config.write_text("version: v1\nsharing: {splitCount: 2}\nhostRoot: /elsewhere\n")
    served.wait_log("needs a restart")
    assert len(served.kubelet.devices(RES) or []) == 16
    text = scrape(served)
    assert sample(text, "vgpu_config_reloads_total", result="ok") == 1
    assert sample(text, "vgpu_config_reloads_total", result="error") == 2


def test_sigterm_stops_cleanly_and_removes_the_socket(served: Served) -> None:
    assert served.proc is not None
    ours = [p for p in served.plugin_dir.iterdir() if p.name != "kubelet.sock"]
    assert len(ours) == 1
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=10) == 0
    assert not ours[0].exists()


def serve_once(node: Node, tmp_path: Path, config_text: str) -> subprocess.CompletedProcess[str]:
    """Run serve on a host root with no shim installed; it must exit rather than serve."""
    config = tmp_path / "config.yaml"
    config.write_text(config_text)
    return subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(config),
         "--device-plugin-dir", str(tmp_path / "dp"), "--host-root", str(tmp_path / "empty"),
         "--state-dir", str(tmp_path / "state"), "--metrics-address", "127.0.0.1:0"],
        env=node.env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_missing_shim_refuses_to_start(simgpu_node: Node, tmp_path: Path) -> None:
    proc = serve_once(simgpu_node, tmp_path, "version: v1\n")
    assert proc.returncode == 3
    assert "install-shim" in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_config_refuses_to_start(simgpu_node: Node, tmp_path: Path) -> None:
    proc = serve_once(simgpu_node, tmp_path, "version: v2\n")
    assert proc.returncode == 2
    assert "version" in proc.stderr


def test_an_alias_bomb_refuses_to_start_with_exit_2_in_one_line(
    simgpu_node: Node, tmp_path: Path
) -> None:
    from core import yaml_bombs

    proc = serve_once(simgpu_node, tmp_path, yaml_bombs.COMPLEX_KEY)
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "cannot start" in x]
    assert "is invalid" in line and "a key must be a plain value" in line
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr


def scrape(served: Served) -> str:
    logs = served.wait_log("metrics on")
    port = int(re.search(r"metrics on \S+ \(port (\d+)\)", logs).group(1))  # type: ignore[union-attr]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        named = line.startswith((name + "{", name + " "))
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


def test_the_probes_say_alive_and_ready_once_registered(served: Served) -> None:
    from commands.test_cli import probe

    logs = served.wait_log("metrics on")
    port = int(re.search(r"metrics on \S+ \(port (\d+)\)", logs).group(1))  # type: ignore[union-attr]
    served.kubelet.wait_registrations(1, timeout=30)
    assert probe(port, "/healthz") == (200, "ok\n")
    deadline = time.monotonic() + 30  # the plugin learns of its registration just after it
    while probe(port, "/readyz") != (200, "ok\n"):
        assert time.monotonic() < deadline, probe(port, "/readyz")
        time.sleep(0.05)


def test_metrics_show_an_allocation_before_its_first_cuda_call(served: Served) -> None:
    a, _ = served.uuids()
    resp = served.kubelet.allocate(RES, [f"{a}-0", f"{a}-1"])
    aid = resp.container_responses[0].envs["VGPU_ALLOCATION_ID"]
    text = scrape(served)
    limit = sample(text, "vgpu_container_memory_limit_bytes", allocation_id=aid, gpu_uuid=a)
    assert limit == 2 * (16384 // 4) * 2**20
    assert sample(text, "vgpu_container_memory_used_bytes", allocation_id=aid) == 0
    assert sample(text, "vgpu_container_compute_limit_ratio", allocation_id=aid) == 0.5
    assert sample(text, "vgpu_gpu_slices", gpu_uuid=a) == 4
    assert sample(text, "vgpu_registrations_total") == 1
    assert sample(text, "vgpu_allocate_seconds_count") == 1


def test_ended_pods_are_cleaned_up_and_nothing_without_the_kubelet(served: Served) -> None:
    a, b = served.uuids()
    kept = served.kubelet.allocate(RES, [f"{a}-0"]).container_responses[0]
    gone = served.kubelet.allocate(RES, [f"{b}-0"]).container_responses[0]
    kept_id, gone_id = kept.envs["VGPU_ALLOCATION_ID"], gone.envs["VGPU_ALLOCATION_ID"]
    # pod-resources unreachable: nothing is deleted however long we wait, said once (the
    # first pass said it; the grace of 1 s and more passes go by)
    served.wait_log("nothing is cleaned up")
    time.sleep(2.5)
    assert {r.allocation_id for r in AllocationStore(served.state_dir).all()} == {kept_id, gone_id}
    assert served.logs().count("nothing is cleaned up") == 1
    served.podres.assign("ns", "web", "main", RES, [f"{a}-0"])
    served.podres.start()
    try:
        deadline = time.monotonic() + 30

        def records() -> list[tuple[str, str | None, str | None]]:
            return [
                (r.allocation_id, r.pod, r.namespace)
                for r in AllocationStore(served.state_dir).all()
            ]

        # the release removes the files first and drops the record last: wait for both
        while (served.host_root / "limits" / gone_id).exists() or len(records()) != 1:
            assert time.monotonic() < deadline, served.logs()
            time.sleep(0.1)
        assert not (served.host_root / "containers" / gone_id).exists()
        assert records() == [(kept_id, "web", "ns")]
        assert (served.host_root / "limits" / kept_id).exists()
    finally:
        served.podres.stop()


@dataclass
class DraServed:
    devices: KubeletEmulator
    dra: DraKubeletEmulator
    api: FakeApiServer
    http: FakeApiHttp
    proc: subprocess.Popen[bytes]
    host_root: Path
    log: Path
    argv: list[str]
    env: dict[str, str]
    state_dir: Path
    cdi_dir: Path

    def kill(self) -> None:
        """SIGKILL: as a crash, or the power loss that takes the process with the node."""
        self.proc.kill()
        self.proc.wait()

    def start(self) -> None:
        """Starts serve again (after ``kill``) and waits until its DRA driver registered."""
        self.dra.restart()  # forgets the last registration, so the wait is for this one
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=out)
        try:
            self.dra.wait_registered(dra.DRIVER_NAME, timeout=30)
        except TimeoutError:
            raise AssertionError(self.log.read_text()) from None


@contextlib.contextmanager
def serve_with_dra(node: Node, native_tree: Path, tmp_path: Path, gpus: str) -> Iterator[DraServed]:
    """`serve` with `dra.enabled` for ``gpus``, beside the device-plugin kubelet emulator, the
    DRA kubelet emulator and an API server it reaches through its kubeconfig."""
    host_root = tmp_path / "host"
    install_shim(host_root, native_tree)
    sockets = short_tmp_dir("serve-dra-")
    (sockets / "registry").mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"version: v1\nsharing: {{splitCount: 4}}\nhostRoot: {host_root}\n"
        f"dra: {{enabled: true, gpus: {gpus}}}\n"
    )
    api = FakeApiServer()
    http = FakeApiHttp(api).start()
    env = node.env()
    env["KUBECONFIG"] = str(http.write_kubeconfig(tmp_path / "kubeconfig"))
    env["VGPU_DRA_REGISTRY_DIR"] = str(sockets / "registry")
    env["VGPU_DRA_PLUGINS_DIR"] = str(sockets / "plugins")
    log = tmp_path / "plugin.log"
    argv = [
        sys.executable, "-m", "vgpu_plugin", "serve",
        "--config", str(config), "--device-plugin-dir", str(sockets),
        "--state-dir", str(tmp_path / "state"), "--cdi-spec-dir", str(tmp_path / "cdi"),
        "--lock-dir", str(tmp_path / "locks"), "--node-name", "node-1",
        "--metrics-address", "127.0.0.1:0",
        "--pod-resources-socket", str(sockets / "podres.sock"),
    ]  # fmt: skip
    devices = KubeletEmulator(sockets)
    dra_kubelet = DraKubeletEmulator(sockets / "registry", "node-1", api)
    devices.start()
    dra_kubelet.start()
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out)
    served: DraServed | None = None
    try:
        try:
            dra_kubelet.wait_registered(dra.DRIVER_NAME, timeout=30)
        except TimeoutError:
            raise AssertionError(log.read_text()) from None
        served = DraServed(
            devices, dra_kubelet, api, http, proc, host_root, log, argv, env,
            tmp_path / "state", tmp_path / "cdi",
        )  # fmt: skip
        yield served
    finally:
        if served is not None:
            proc = served.proc
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        dra_kubelet.stop()
        devices.stop()
        http.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def wait_until(predicate: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_serve_with_dra_registers_with_the_kubelet_and_publishes_the_slice(
    simgpu_node: Node, native_tree: Path, tmp_path: Path
) -> None:
    with serve_with_dra(simgpu_node, native_tree, tmp_path, "[all]") as s:
        wait_until(lambda: len(s.api.slices) == 1)
        (published,) = s.api.slices.values()
        assert published["spec"]["nodeName"] == "node-1"
        uuids = [g.uuid for g in simgpu_node.gpus()]
        assert sorted(d["attributes"]["uuid"]["string"] for d in published["spec"]["devices"]) == (
            sorted(uuids)
        )
        # Through the real kubernetes client: the slice was created over HTTP.
        assert f"POST {FakeApiHttp._SLICES}" in s.http.calls
        # A kubelet restart deletes the node's slices: the driver publishes again.
        s.dra.restart()
        s.dra.wait_registered(dra.DRIVER_NAME, timeout=30)
        wait_until(lambda: len(s.api.slices) == 1)


def test_serve_splits_a_node_between_the_device_plugin_and_dra(
    simgpu_node: Node, native_tree: Path, tmp_path: Path
) -> None:
    a, b = (g.uuid for g in simgpu_node.gpus())
    with serve_with_dra(simgpu_node, native_tree, tmp_path, '["1"]') as s:
        # GPU 0: four slices of the device plugin; GPU 1: the DRA driver's one device.
        s.devices.wait_registrations(1, timeout=30)
        advertised = s.devices.wait_devices(RES, lambda d: len(d) == 4, timeout=10)
        assert {d.ID.rsplit("-", 1)[0] for d in advertised} == {a}
        wait_until(lambda: len(s.api.slices) == 1)
        (published,) = s.api.slices.values()
        assert [d["attributes"]["uuid"]["string"] for d in published["spec"]["devices"]] == [b]
        # A claim on GPU 1 is prepared by the serve process; a slice of GPU 0 is allocated.
        s.api.add_claim("ml", "infer", {"gpu": {"memory": "6Gi", "compute": "30"}})
        claim = s.api.allocate("ml", "infer", published["spec"]["devices"][0]["name"])
        uid = claim["metadata"]["uid"]
        entry = s.dra.prepare(dra.DRIVER_NAME, claim).claims[uid]
        assert entry.error == "", s.log.read_text()
        limits = (s.host_root / "limits" / f"dra-{uid}").read_text()
        assert b in limits and a not in limits
        resp = s.devices.allocate(RES, [f"{a}-0"])
        assert resp.container_responses[0].cdi_devices or resp.container_responses[0].mounts


def test_serve_caps_malloc_arenas_where_the_c_library_is_glibc() -> None:
    import platform

    from vgpu_plugin.commands.serve import limit_malloc_arenas

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    # In a process of its own: the cap stays for the life of the process that sets it.
    code = "from vgpu_plugin.commands.serve import limit_malloc_arenas as f; assert f()"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    assert callable(limit_malloc_arenas)


@pytest.mark.skipif(
    NO_NAMESPACES,
    reason="needs root and unshare(1)/mount(8): the container is a mount namespace here",
)
def test_serve_exports_and_logs_a_containers_process_that_runs_without_the_shim(
    served: Served, native_tree: Path, tmp_path: Path
) -> None:
    """The wiring of node/observe/escapes.py in serve: a process in the allocation's mount
    namespace (its limits file mounted, as the runtime mounts it) that holds memory on the
    GPU with no shim in it is counted in the allocation's series and named in the log."""
    a, _ = served.uuids()
    resp = served.kubelet.allocate(RES, [f"{a}-0"]).container_responses[0]
    aid = resp.envs["VGPU_ALLOCATION_ID"]
    point = tmp_path / "etc-vgpu-limits"
    point.touch()
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    hold = [str(native_tree / "tests" / "shim_mem"), "handle", "0", "alloc", str(64 << 20), "1"]
    bare = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
         str(served.host_root / "limits" / aid), str(point), *hold, "hold"],
        env=served.node.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert bare.stdout is not None
        while bare.stdout.readline().strip() != "holding":
            assert bare.poll() is None, "shim_mem ended before holding its memory"
        # the watch looks every 10 s (escapes.INTERVAL): a loaded host's bound is a few looks
        deadline = time.monotonic() + 60
        while True:
            text = scrape(served)
            n = sample(text, "vgpu_container_unshimmed_processes", allocation_id=aid, gpu_uuid=a)
            if n == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert n == 1, text
        held = sample(text, "vgpu_container_unshimmed_memory_bytes", allocation_id=aid)
        assert held >= 64 << 20
        # no pod-resources here: logged by its allocation after a few looks (NAME_WAIT_LOOKS)
        served.wait_log(f"process {bare.pid} (the node's pid) uses GPU {a}", timeout=90)
    finally:
        bare.communicate("", timeout=60)
    # gone from the GPU: the next look counts nothing
    deadline = time.monotonic() + 60
    while sample(scrape(served), "vgpu_container_unshimmed_processes", allocation_id=aid):
        assert time.monotonic() < deadline
        time.sleep(0.5)
