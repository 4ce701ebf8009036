"""What operators see of pacing, from real shim processes on simgpu: the time a container's
launches were held back (its pacing file, which the shim writes and the node reads) in the
node view, `status` and the metrics (docs/metrics.md).

Nothing is timed by the wall clock: the paced container's GPU time is simgpu's own record
(`Node.busy`), and the held-back figure is compared with it, not with a window of seconds:
a container capped at 25 % has to wait about three times its GPU time; a loaded host that
delays its launcher (starving it instead of making it wait) lowers that by at most one
bucket (40 ms x 25 %) per stall, so half its GPU time is a floor far below what it waits.
"""

from __future__ import annotations

import gzip
import re
import time
from pathlib import Path

from test_shim_compute import launch, shim_on
from test_shim_helpers import Shim, finish

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.ledger.state import AllocationRecord
from vgpu_plugin.node.observe.metrics import NodeViewExposition
from vgpu_plugin.node.observe.nodeview import (
    NodeView,
    build_view,
    read_paces,
    read_regions,
    region_path,
)
from vgpu_plugin.node.observe.pace import read_pace

SECONDS = 2


def env_of(shim: Shim, root: Path, allocation_id: str, **limits: str) -> dict[str, str]:
    """A container laid out as on a node: its region under <root>/containers/<id>/."""
    env = shim.env(limits)
    path = region_path(root, allocation_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(path)
    return env


def view_of(root: Path, records: list[AllocationRecord]) -> NodeView:
    ids = [r.allocation_id for r in records]
    return build_view(
        records, read_regions(root, ids), [], paces=read_paces(root, ids), now=time.time()
    )


def scraped(view: NodeView, name: str) -> dict[str, float]:
    """The metric's value per allocation_id, as a scrape returns it."""
    text = gzip.decompress(NodeViewExposition(lambda: view).gzipped()).decode()
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        aid = re.search(r'allocation_id="([^"]*)"', m.group(1))
        assert aid is not None
        out[aid.group(1)] = float(m.group(2))
    return out


def test_a_paced_containers_held_back_time_grows_and_an_unpaced_ones_stays_0(
    native_tree: Path, tmp_path: Path
) -> None:
    shim = shim_on(native_tree, tmp_path, 1)
    uuid = shim.node.gpu(0).uuid
    root = tmp_path / "host"
    paced = env_of(shim, root, "paced", CUDA_DEVICE_SM_LIMIT="25")
    free = env_of(shim, root, "free")
    created = time.time()
    records = [
        AllocationRecord(
            aid, (f"{uuid}-{k}",), "nvidia.com/gpu", created, (GpuLimit(uuid, 0, cap),)
        )
        for k, (aid, cap) in enumerate((("paced", 25), ("free", 0)))
    ]
    held: list[float] = []
    for _ in range(2):  # two runs: the figure grows with each
        t0 = time.monotonic_ns()
        procs = [launch(shim, e, 0, "kernel", SECONDS) for e in (paced, free)]
        for p in procs:
            r = finish(p, timeout=120)
            assert r.rc == 0, r.stderr
        gpu_ns = shim.node.busy(0, t0, time.monotonic_ns()).get(procs[0].pid, 0)
        assert gpu_ns > 0
        view = view_of(root, records)
        by_id = {a.id: a for a in view.allocations}
        got = by_id["paced"].gpus[0].compute_held_back_seconds
        assert got is not None and got >= 0.5 * gpu_ns / 1e9 + (held[-1] if held else 0), (
            got,
            gpu_ns,
            held,
        )
        held.append(got)
        # The unpaced container waits for nothing (it has no pacing file, or a record of 0).
        assert by_id["free"].gpus[0].compute_held_back_seconds == 0.0
        assert by_id["free"].pace_state in ("ok", "missing")
        # The scrape says the same, read from the same file the shim wrote.
        series = scraped(view, "vgpu_container_compute_held_back_seconds_total")
        assert series == {"paced": got, "free": 0.0}
        pace = read_pace(region_path(root, "paced").with_suffix(".pace"))
        assert isinstance(pace, tuple) and pace[0].uuid == uuid
        assert pace[0].held_ns / 1e9 == got
    assert held[1] > held[0]
