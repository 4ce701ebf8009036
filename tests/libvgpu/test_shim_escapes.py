"""A process of a container that runs without the shim (an image whose loader cannot preload
it, a static binary) is found by the node agent and named, with what it holds: NVML lists it
(simgpu's, through pynvml, as serve reads it), the container's mounts attribute it, and its
region has no slot for it (node/observe/escapes.py; docs/security.md).

Each "container" is its processes in mount namespaces of their own with the container's
limits file bind-mounted, as in test_shim_multiproc.py; every process here holds memory on
the GPU until its stdin closes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_NAMESPACES
from test_shim_compute import shim_on
from test_shim_helpers import Shim, read_until
from test_shim_multiproc import WHY, container

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.ledger.state import AllocationRecord, AllocationStore
from vgpu_plugin.node.observe import escapes

pytestmark = pytest.mark.skipif(NO_NAMESPACES, reason=WHY)

MIB = 1 << 20

# The watch as serve runs it every 10 s, in a process of its own (pynvml must load
# simgpu's libnvidia-ml, which the node's env points the loader at); prints what it found.
WATCH = """
import json, sys
from pathlib import Path
from vgpu_plugin.node.gpu.nvml import running_processes
from vgpu_plugin.node.observe.escapes import EscapeWatch
from vgpu_plugin.node.observe.nodeview import region_slots
root, uuid, ids = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
watch = EscapeWatch(root, running_processes, region_slots(root))
found = watch({i: {uuid} for i in ids}, {i: f"container {i}" for i in ids})
print(json.dumps([[e.allocation_id, e.uuid, e.pid, e.memory] for e in found]))
"""


def record(alloc: str, uuid: str, k: int) -> AllocationRecord:
    return AllocationRecord(
        allocation_id=alloc,
        device_ids=(f"{uuid}-{k}",),
        resource_name="nvidia.com/gpu",
        created=1.0,
        limits=(GpuLimit(uuid, 8 << 30, 100),),
        namespace="ml",
        pod=alloc,
        container="main",
    )


def hold_in_container(
    shim: Shim, root: Path, alloc: str, env: dict[str, str], mib: int, with_shim: bool
) -> subprocess.Popen[str]:
    """shim_mem holding ``mib`` in a mount namespace with ``alloc``'s limits file mounted;
    the shim preloaded into it or not (never into unshare, sh or mount)."""
    point = root / "etc-vgpu-limits"
    point.touch()
    env = dict(env)
    preload = env.pop("LD_PRELOAD")
    env["VGPU_TEST_PRELOAD"] = preload if with_shim else ""
    script = 'mount --bind "$1" "$2" && shift 2 && export LD_PRELOAD="$VGPU_TEST_PRELOAD"'
    script += ' && exec "$@"'
    args = [str(shim.prog("shim_mem")), "handle", "0", "alloc", str(mib * MIB), "1", "hold"]
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    cmd += [str(root / "limits" / alloc), str(point), *args]
    proc = subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    got = read_until(proc, "holding")
    assert got["allocated"] == str(mib * MIB), got
    return proc


def test_the_node_agent_names_the_process_of_a_container_that_runs_without_the_shim(
    native_tree: Path, tmp_path: Path
) -> None:
    shim = shim_on(native_tree, tmp_path, 1)
    uuid = shim.node.gpu(0).uuid
    root = tmp_path / "host"
    env_a = container(shim, root, "ctr-a", uuid, 0)
    env_b = container(shim, root, "ctr-b", uuid, 0)
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(hold_in_container(shim, root, "ctr-a", env_a, 256, with_shim=True))
        bare = hold_in_container(shim, root, "ctr-a", env_a, 512, with_shim=False)
        procs.append(bare)
        procs.append(hold_in_container(shim, root, "ctr-b", env_b, 128, with_shim=True))
        # the node's own process without the shim, in no container: nobody's to report
        outside = shim.start("shim_mem", "handle", 0, "alloc", 64 * MIB, 1, "hold",
                             env=shim.env(shim=False))  # fmt: skip
        procs.append(outside)
        read_until(outside, "holding")
        watch_env = shim.env(shim=False)
        watch_env["PYTHONPATH"] = str(Path(escapes.__file__).parents[3])
        out = subprocess.run(
            [sys.executable, "-c", WATCH, str(root), uuid, "ctr-a", "ctr-b"],
            env=watch_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        found = json.loads(out.stdout)
        # Only the bare one, with what it holds (its context's memory too, as NVML counts it)
        assert [f[:3] for f in found] == [["ctr-a", uuid, bare.pid]], (found, out.stderr)
        assert found[0][3] >= 512 * MIB, found
        assert f"container ctr-a: process {bare.pid} (the node's pid) uses GPU {uuid}" in out.stderr
        assert "without the shim" in out.stderr
        # `vgpu-plugin status` on the same node says it per container
        store = AllocationStore(tmp_path / "state")
        store.add_many([record(name, uuid, k) for k, name in enumerate(("ctr-a", "ctr-b"))])
        status = subprocess.run(
            [sys.executable, "-m", "vgpu_plugin", "status", "--host-root", str(root),
             "--state-dir", str(tmp_path / "state"),
             "--pod-resources-socket", str(tmp_path / "no.sock")],
            env=watch_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        warned = [ln for ln in status.stdout.splitlines() if "without the shim" in ln]
        assert len(warned) == 1, status.stdout
        assert warned[0].startswith(f"warning: allocation ctr-a: 1 process(es) on GPU 0 {uuid}")
    finally:
        for p in procs:
            p.communicate("", timeout=60)
