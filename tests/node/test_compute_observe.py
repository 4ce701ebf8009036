"""Compute figures of the node view (docs/metrics.md): the held-back time read from each
container's pacing file, which its tenant can write, and each GPU's idle time lent.

The pacing files here are written byte by byte at the shim's offsets (synthetic_regions.
pace_bytes), so a reader that drifts from the shim's layout fails; real shim processes
write them in tests/libvgpu/test_shim_held_back.py."""

from __future__ import annotations

import gzip
import os
import re
import struct
import time
from pathlib import Path

import pytest
from synthetic_regions import Dev, Proc, Snap, pace_bytes, prepared_claim

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import AllocationRecord, AllocationStore
from vgpu_plugin.node.observe import metrics
from vgpu_plugin.node.observe.lending import LendingMeter, LendingSample
from vgpu_plugin.node.observe.nodeview import region_path, staged_view_provider
from vgpu_plugin.node.observe.pace import (
    MAX_WAITERS,
    PaceDevice,
    PaceProblem,
    pace_path,
    read_pace,
)

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
S = 1_000_000_000


def rec(aid: str, created: float, *limits: GpuLimit, k: int = 0) -> AllocationRecord:
    devices = tuple(f"{g.uuid}-{k}" for g in limits)
    return AllocationRecord(aid, devices, "nvidia.com/gpu", created, limits)


def pace_of(root: Path, aid: str) -> Path:
    path = pace_path(region_path(root, aid))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# --- reading one file ------------------------------------------------------------------------


def test_a_pacing_file_gives_each_gpus_guarantee_and_held_back_time(tmp_path: Path) -> None:
    path = tmp_path / "a.pace"
    path.write_bytes(pace_bytes((GPU_A, 25, 3 * S), (GPU_B, 0, 7)))
    assert read_pace(path) == (PaceDevice(GPU_A, 25, 3 * S), PaceDevice(GPU_B, 0, 7))
    assert read_pace(tmp_path / "none.pace") is None


def _hostile(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "x.pace"
    good = pace_bytes((GPU_A, 25, S))
    if kind == "magic":
        path.write_bytes(pace_bytes((GPU_A, 25, S), magic=b"VGPUREG\0"))
    elif kind == "version":
        path.write_bytes(pace_bytes((GPU_A, 25, S), version=2))
    elif kind == "short":
        path.write_bytes(good[:100])
    elif kind == "long":
        path.write_bytes(good + b"\0" * 64)
    elif kind == "huge":  # never read whole: the size is refused first
        with path.open("wb") as f:
            f.truncate(1 << 40)
    elif kind == "header size":
        data = bytearray(good)
        struct.pack_into("<Q", data, 16, 1 << 40)
        path.write_bytes(bytes(data))
    elif kind == "count":
        data = bytearray(good)
        struct.pack_into("<I", data, 12, 1000)
        path.write_bytes(bytes(data))
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(good)
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":  # opened without blocking, refused as not a file
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    return path


KINDS = ["magic", "version", "short", "long", "huge", "header size", "count", "symlink"]


@pytest.mark.parametrize("kind", [*KINDS, "fifo", "directory"])
def test_a_file_that_is_not_a_pacing_file_is_refused_whole(tmp_path: Path, kind: str) -> None:
    got = read_pace(_hostile(tmp_path, kind))
    assert isinstance(got, PaceProblem) and got.state.startswith("invalid: "), got


# --- in the view and the scrape --------------------------------------------------------------


def scrape(root: Path, store: AllocationStore) -> str:
    """A scrape of the node's figures (no region written: the pacing files alone)."""

    def read_region(path: Path) -> Snap:
        raise OSError(f"{path}: no such file")

    prepare = staged_view_provider(root, store.all, lambda: [], read_region, meter=LendingMeter())
    return gzip.decompress(metrics.NodeViewExposition(lambda: prepare()()).gzipped()).decode()


def series(text: str, name: str) -> dict[tuple[str, str], float]:
    """(allocation_id or '', gpu_uuid) -> value of every sample of ``name``."""
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[(labels.get("allocation_id", ""), labels["gpu_uuid"])] = float(m.group(2))
    return out


HELD = "vgpu_container_compute_held_back_seconds_total"


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_pacing_file_costs_only_its_own_containers_figure(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "host"
    store = AllocationStore(tmp_path / "state")
    now = time.time()
    store.add(rec("good", now - 100, GpuLimit(GPU_A, 0, 25)))
    store.add(rec("bad", now - 100, GpuLimit(GPU_A, 0, 25), k=1))
    store.add(rec("none", now - 100, GpuLimit(GPU_B, 0, 0), k=2))
    pace_of(root, "good").write_bytes(pace_bytes((GPU_A, 25, 3 * S)))
    pace_of(root, "bad")
    os.replace(_hostile(tmp_path, kind), pace_of(root, "bad"))
    text = scrape(root, store)
    assert "vgpu_node_view_up 1.0" in text
    assert series(text, HELD) == {("good", GPU_A): 3.0, ("none", GPU_B): 0.0}


def test_held_back_figures_are_clamped_and_foreign_gpus_ignored(tmp_path: Path) -> None:
    """A tenant that writes 2^64-1 ns shows at most what its processes could have waited
    in its life; a record of a GPU the allocation lacks is no figure of any GPU."""
    root = tmp_path / "host"
    store = AllocationStore(tmp_path / "state")
    store.add(rec("liar", time.time() - 10, GpuLimit(GPU_A, 0, 25)))
    pace_of(root, "liar").write_bytes(pace_bytes((GPU_B, 25, 5 * S), (GPU_A, 25, (1 << 64) - 1)))
    got = series(scrape(root, store), HELD)
    assert list(got) == [("liar", GPU_A)]
    assert 10 * MAX_WAITERS <= got[("liar", GPU_A)] <= 12 * MAX_WAITERS


# --- idle time lent ---------------------------------------------------------------------------


def test_lent_time_is_gpu_time_used_beyond_the_guarantee() -> None:
    meter = LendingMeter()

    def at(t: float, *samples: tuple[str, str, int, int]) -> dict[str, float]:
        return meter.observe(t, [LendingSample(*s) for s in samples])

    # A (25 %) and B (50 %) on GPU A, C (25 %) on GPU B; first sight: nothing measured yet.
    assert at(10.0, ("a", GPU_A, 25, 0), ("b", GPU_A, 50, 0), ("c", GPU_B, 25, 0)) == {
        GPU_A: 0.0,
        GPU_B: 0.0,
    }
    # 2 s: A ran 1.5 s (0.5 s of its own, 1 s lent), B 0.5 s (under its 1 s: lends, takes
    # nothing), C all 2 s (0.5 own, 1.5 lent).
    got = at(12.0, ("a", GPU_A, 25, 3 * S // 2), ("b", GPU_A, 50, S // 2), ("c", GPU_B, 25, 2 * S))
    assert got == pytest.approx({GPU_A: 1.0, GPU_B: 1.5})
    # A forged region: more GPU time than time passed counts as all of it; a counter that
    # went back (a region made again) starts over, and adds nothing.
    got = at(13.0, ("a", GPU_A, 25, 100 * S), ("c", GPU_B, 25, 0))
    assert got == pytest.approx({GPU_A: 1.75, GPU_B: 1.5})
    got = at(14.0, ("a", GPU_A, 25, 100 * S), ("c", GPU_B, 25, S))
    assert got == pytest.approx({GPU_A: 1.75, GPU_B: 2.25})
    # An observation older than the last (two scrapes at once) changes nothing.
    got = at(13.5, ("a", GPU_A, 25, 50 * S), ("c", GPU_B, 25, S // 2))
    assert got == pytest.approx({GPU_A: 1.75, GPU_B: 2.25})
    # An allocation gone and back is measured from when it is seen again.
    at(15.0)
    assert at(16.0, ("a", GPU_A, 25, 200 * S)) == pytest.approx({GPU_A: 1.75, GPU_B: 2.25})


def test_the_scrape_exports_each_gpus_lent_time_from_the_guaranteed_regions(
    tmp_path: Path,
) -> None:
    """Between two builds a guaranteed container of either front end that used more than
    its guarantee is counted on its GPU; a capped one (no guarantee) is not."""
    root = tmp_path / "host"
    store = AllocationStore(tmp_path / "state")
    store.add(rec("g", 1.0, GpuLimit(GPU_A, 0, 100, compute_request=25)))
    store.add(rec("capped", 1.0, GpuLimit(GPU_A, 0, 50), k=1))
    ClaimLedger(store).put(
        prepared_claim("u", GpuLimit(GPU_B, 0, 100, compute_request=50), created=2.0), "prepared"
    )
    clock = [100.0]
    regions: dict[Path, Snap] = {}

    def put(aid: str, uuid: str, gpu_ns: int) -> None:
        path = region_path(root, aid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"r")
        regions[path] = Snap((Dev(uuid, 0, gpu_ns=gpu_ns),), (Proc(True, (0,)),))

    prepare = staged_view_provider(
        root, store.all, lambda: [], lambda p: regions[p], meter=LendingMeter(),
        clock=lambda: clock[0],
    )  # fmt: skip
    exposition = metrics.NodeViewExposition(lambda: prepare()())

    def lent() -> dict[str, float]:
        text = gzip.decompress(exposition.gzipped()).decode()
        return {g: v for (_, g), v in series(text, "vgpu_gpu_compute_lent_seconds_total").items()}

    for aid, uuid in (("g", GPU_A), ("capped", GPU_A), ("dra-u", GPU_B)):
        put(aid, uuid, 0)
    assert lent() == {GPU_A: 0.0, GPU_B: 0.0}
    clock[0] += 4.0  # g ran 3 of 4 s (2 beyond its 1), capped 2 s, the claim 1 (under its 2)
    put("g", GPU_A, 3 * S)
    put("capped", GPU_A, 2 * S)
    put("dra-u", GPU_B, 1 * S)
    assert lent() == pytest.approx({GPU_A: 2.0, GPU_B: 0.0})
