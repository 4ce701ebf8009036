"""DRA driver figures: NodePrepareResources and NodeUnprepareResources p50/p99 with
``--records`` allocations already in the ledger (docs/contracts.md#performance-targets: one
caller p99 <= 5 ms at 2,000 records, the same target as Allocate), beside the floor: a call
with no claim on the same channel before each prepare, so that a slow minute on a shared
machine shows as such.

Runs the real `vgpu-plugin serve` process with `dra.enabled` on a simulated node of 8 GPUs,
its API server the in-process fake reached over HTTP through a kubeconfig (as the real
`kubernetes` client reaches a real one), and calls the driver over its real unix socket on one
kept channel, as the kubelet does. Each of ``--calls`` rounds prepares one claim (6 GiB and 10 %
of a GPU, every GPU in turn) and unprepares it, so the ledger stays at ``--records`` plus one;
the plugin's CPU per round is printed beside the latencies (a loaded machine moves it least).
The records on file are device-plugin records seeded as ``bench_plugin.py`` seeds them: the
ledger is one journal for both front ends.

    VGPU_NATIVE_DIR=build/native-release python bench/bench_dra.py [--calls 500] [--records 2000]
        [--serve-src <another checkout>/src]

It asserts nothing: it prints figures.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from bench_plugin import RES, cpu_seconds, pct, report, rss_mib, seed_records

from vgpu_plugin.api.dra.v1 import api_pb2 as v1
from vgpu_plugin.api.dra.v1 import api_pb2_grpc as v1_grpc
from vgpu_plugin.core import dra
from vgpu_plugin.node.host.install import install_shim
from vgpu_plugin.sim.dra_kubelet import DraKubeletEmulator, FakeApiHttp, FakeApiServer
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, short_tmp_dir
from vgpu_plugin.sim.simgpu import GpuSpec, Node

# Runs a module from the tree given first, whatever package an editable install put on the
# path: its import hook comes before PYTHONPATH, so PYTHONPATH alone ran this tree's plugin in
# every "other tree" of a comparison (found 2026-11-29: earlier pairs measured main twice).
_FROM_TREE = """
import runpy, sys
src = sys.argv.pop(1)
sys.meta_path[:] = [f for f in sys.meta_path if "_editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, src)
import vgpu_plugin
assert vgpu_plugin.__file__.startswith(src), (vgpu_plugin.__file__, src)
sys.argv[0] = sys.argv.pop(1)
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def serve_python(src: Path) -> list[str]:
    """The command that runs ``-m <module>`` from ``src`` (another checkout's ``src/``)."""
    tree = str(src.resolve())
    found = subprocess.run(
        [sys.executable, "-c", _FROM_TREE, tree, "vgpu_plugin.commands.settings"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if found.returncode != 0:
        raise SystemExit(f"--serve-src {src}: cannot run the plugin from there: {found.stderr}")
    print(f"serve runs from {tree}")
    return [sys.executable, "-c", _FROM_TREE, tree]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--records", type=int, default=2000, help="records in the ledger at start")
    ap.add_argument(
        "--serve-src", type=Path, help="run serve from this tree's src/ (to compare versions)"
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-dra-"))
    node = Node.create(work / "simgpu", [GpuSpec(numa_node=i // 4) for i in range(8)])
    install_shim(work / "host")
    sockets = short_tmp_dir("bench-dra-")
    (sockets / "registry").mkdir()
    # The device plugin keeps GPU 0 (the seeded records name its slices); DRA gets the rest.
    (work / "config.yaml").write_text(
        "version: v1\nsharing: {splitCount: 32}\n"
        'dra: {enabled: true, gpus: ["1", "2", "3", "4", "5", "6", "7"]}\n'
    )
    api = FakeApiServer()
    http = FakeApiHttp(api).start()
    env = node.env()
    env["KUBECONFIG"] = str(http.write_kubeconfig(work / "kubeconfig"))
    env["VGPU_DRA_REGISTRY_DIR"] = str(sockets / "registry")
    env["VGPU_DRA_PLUGINS_DIR"] = str(sockets / "plugins")
    # Only the plugin differs with --serve-src: the bench, its API server and client stay.
    python = serve_python(args.serve_src) if args.serve_src else [sys.executable, "-m"]
    cmd = [*python, "vgpu_plugin", "serve", "--config", str(work / "config.yaml"),
           "--device-plugin-dir", str(sockets), "--host-root", str(work / "host"),
           "--state-dir", str(work / "state"), "--lock-dir", str(work / "locks"),
           "--cdi-spec-dir", str(work / "cdi"), "--node-name", "node-1",
           "--metrics-address", "127.0.0.1:0", "--log-level", "warning",
           "--pod-resources-socket", str(sockets / "podres.sock")]  # fmt: skip
    kubelet = KubeletEmulator(sockets, call_timeout=600)
    dra_kubelet = DraKubeletEmulator(sockets / "registry", "node-1", api, call_timeout=600)
    kubelet.start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        if args.records:
            # The slice IDs are known once the plugin advertises them: start it once.
            proc = subprocess.Popen(cmd, env=env)
            ids = [d.ID for d in kubelet.wait_devices(RES, lambda d: len(d) == 32, timeout=120)]
            proc.terminate()
            proc.wait(10)
            kubelet.stop()
            kubelet = KubeletEmulator(sockets, call_timeout=600)
            kubelet.start()
            seed_records(work / "state", args.records, ids)
        dra_kubelet.start()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env)
        registration = dra_kubelet.wait_registered(dra.DRIVER_NAME, timeout=120)
        print(f"DRA driver registered {time.perf_counter() - t0:.2f} s after start "
              f"({args.records} records on file)")  # fmt: skip
        deadline = time.monotonic() + 60
        while not api.slices and time.monotonic() < deadline:
            time.sleep(0.05)
        (published,) = api.slices.values()
        devices = [d["name"] for d in published["spec"]["devices"]]
        claims = []
        for i in range(args.calls):
            api.add_claim("bench", f"c{i}", {"gpu": {"memory": "6Gi", "compute": "10"}})
            claims.append(api.allocate("bench", f"c{i}", devices[i % len(devices)]))
        rss_start = rss_mib(proc.pid)
        cpu0 = cpu_seconds(proc.pid)
        with grpc.insecure_channel(f"unix://{registration.endpoint}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)

            def ref(c: dict[str, Any]) -> Any:
                meta = c["metadata"]
                return v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

            prepare: list[float] = []
            unprepare: list[float] = []
            floor: list[float] = []
            errors = 0
            for c in claims:
                # The floor: the same server, channel and caller, a call with no claim (the
                # gRPC round trip and the server's threads, no work): what this machine gives
                # any call in these minutes, beside the prepare it precedes.
                t = time.perf_counter()
                stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(), timeout=600)
                floor.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                got = stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[ref(c)]), timeout=600
                )
                prepare.append((time.perf_counter() - t) * 1e3)
                errors += sum(1 for r in got.claims.values() if r.error)
                t = time.perf_counter()
                stub.NodeUnprepareResources(
                    v1.NodeUnprepareResourcesRequest(claims=[ref(c)]), timeout=600
                )
                unprepare.append((time.perf_counter() - t) * 1e3)
        cpu = cpu_seconds(proc.pid) - cpu0
        report("NodePrepareResources, one claim", prepare)
        report("NodeUnprepareResources, one claim", unprepare)
        report("the floor: NodeUnprepareResources of no claim", floor, "")
        print(f"prepare p90 {pct(prepare, 90):.2f} ms, p99.9 {pct(prepare, 99.9):.2f} ms, "
              f"max {max(prepare):.2f} ms; {errors} prepare errors")  # fmt: skip
        print(f"plugin CPU: {cpu / len(claims) * 1e3:.2f} ms per prepare, unprepare and floor "
              "call (all its threads; the figure load changes least)")  # fmt: skip
        print(f"plugin RSS: {rss_start:.0f} MiB at start, {rss_mib(proc.pid):.0f} MiB at the end")
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        dra_kubelet.stop()
        kubelet.stop()
        http.stop()
        shutil.rmtree(sockets, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
