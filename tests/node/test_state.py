"""Allocation records: round trip, crash safety, refusing bad files, two writer processes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest

from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.node.state import (
    STATE_FILE_NAME,
    AllocationRecord,
    AllocationStore,
    StateFileError,
    decode,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def record(n: int, **kw: object) -> AllocationRecord:
    fields: dict[str, object] = {
        "allocation_id": f"alloc-{n:04d}",
        "device_ids": (f"GPU-aaaa-{n}", f"GPU-bbbb-{n}"),
        "resource_name": "nvidia.com/gpu",
        "created": 1_700_000_000.25 + n,
        "limits": (GpuLimit("GPU-aaaa", 20389 * MIB, 25), GpuLimit("GPU-bbbb", 40778 * MIB, 50)),
    }
    fields.update(kw)
    return AllocationRecord(**fields)  # type: ignore[arg-type]


def run_python(code: str, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env)


def test_round_trip_and_restart(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path)
    first = record(1)
    second = record(2, pod="infer-0", namespace="ml", container="server")
    store.add(first)
    store.add(second)
    assert store.get("alloc-0001") == first
    assert store.get("missing") is None

    reopened = AllocationStore(tmp_path)  # a restarted plugin
    assert reopened.all() == [first, second]
    again = reopened.get("alloc-0002")
    assert again is not None and again.pod == "infer-0" and again.limits[1].memory_mib == 40778
    assert isinstance(again.device_ids, tuple) and isinstance(again.limits[0], GpuLimit)

    assert reopened.remove("alloc-0001") is True
    assert reopened.remove("alloc-0001") is False
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0002"]


def test_add_replaces_the_same_allocation_id(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path)
    store.add(record(1))
    store.add(record(1, pod="p"))
    assert [r.pod for r in store.all()] == ["p"]


def test_unknown_fields_from_a_newer_writer_survive(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path)
    store.add(record(1))
    path = tmp_path / STATE_FILE_NAME
    payload = msgpack.unpackb(path.read_bytes())
    payload["records"][0]["future_field"] = [1, 2]
    path.write_bytes(msgpack.packb(payload))
    store.add(record(2))
    raw = msgpack.unpackb(path.read_bytes())["records"]
    assert raw[0]["future_field"] == [1, 2]


def test_a_writer_killed_mid_write_never_loses_the_old_records(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path)
    store.add(record(1))
    store.add(record(2))
    ready = tmp_path / "ready"
    # A second process starts writing record 3, then hangs inside the rename, holding the
    # lock with its tmp file fsynced but not renamed; it is then killed with SIGKILL.
    child = run_python(
        """
        import os, sys, time
        from pathlib import Path
        from vgpu_plugin.node import state
        store = state.AllocationStore(sys.argv[1])
        def hang(src, dst):
            Path(sys.argv[2]).write_text("x")
            time.sleep(60)
        os.replace = hang
        store.add(state.AllocationRecord("alloc-0003", ("d",), "nvidia.com/gpu", 1.0))
        """,
        str(tmp_path),
        str(ready),
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert child.poll() is None, "writer exited early"
            assert time.monotonic() < deadline, "writer never reached the rename"
            time.sleep(0.01)
        leftovers = list(tmp_path.glob(f"{STATE_FILE_NAME}.tmp-*"))
        assert len(leftovers) == 1  # the half-done write is really there
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)

    reopened = AllocationStore(tmp_path)  # the kernel released the dead writer's lock
    assert [r.allocation_id for r in reopened.all()] == ["alloc-0001", "alloc-0002"]
    assert not list(tmp_path.glob(f"{STATE_FILE_NAME}.tmp-*")), "stale tmp file not cleaned"
    assert reopened.quarantined == []


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xc1\xc1 not msgpack at all", "not valid msgpack"),
        (msgpack.packb({"hello": "world"}), "not a vgpu-plugin allocations file"),
        (msgpack.packb([1, 2, 3]), "not a vgpu-plugin allocations file"),
        (
            msgpack.packb({"format": "vgpu-plugin/allocations", "version": 99, "records": []}),
            "format version 99",
        ),
        (
            msgpack.packb(
                {"format": "vgpu-plugin/allocations", "version": 1, "records": [{"x": 1}]}
            ),
            "record 0",
        ),
    ],
)
def test_corrupt_or_foreign_file_is_refused_and_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    path = tmp_path / STATE_FILE_NAME
    path.write_bytes(content)
    with pytest.raises(StateFileError, match=reason) as err:
        decode(path, content)
    assert str(path) in str(err.value)

    with caplog.at_level(logging.ERROR, logger="vgpu_plugin.node.state"):
        store = AllocationStore(tmp_path)
    assert store.all() == []
    (aside,) = store.quarantined
    assert aside.name.startswith(f"{STATE_FILE_NAME}.corrupt-")
    assert aside.read_bytes() == content  # kept for a human, never silently dropped
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(path) in line and str(aside) in line and reason in line

    store.add(record(1))  # and the plugin carries on with a fresh file
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0001"]


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    AllocationStore(tmp_path)
    code = """
        import sys
        from vgpu_plugin.node import state
        store = state.AllocationStore(sys.argv[1])
        tag = sys.argv[2]
        for i in range(40):
            store.add(state.AllocationRecord(f"{tag}-{i}", (f"d{i}",), "nvidia.com/gpu", i))
        for i in range(0, 40, 4):
            assert store.remove(f"{tag}-{i}")
        """
    writers = [run_python(code, str(tmp_path), tag) for tag in ("a", "b", "c")]
    for writer in writers:
        assert writer.wait(60) == 0
    got = {r.allocation_id for r in AllocationStore(tmp_path).all()}
    want = {f"{t}-{i}" for t in ("a", "b", "c") for i in range(40) if i % 4}
    assert got == want
