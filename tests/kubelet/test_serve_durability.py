"""The real `vgpu-plugin serve`, SIGKILLed during Allocates and started after a simulated power
loss: no acknowledged allocation loses its record, limits file or region dir, nothing is torn,
and what a power loss took is rebuilt from the kubelet's checkpoint before registering, at the
first start after the node booted."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core.limits import format_limits, parse_limits
from vgpu_plugin.kubelet.checkpoint import CHECKPOINT_NAME
from vgpu_plugin.kubelet.rebuild import _from_response
from vgpu_plugin.node.host import install
from vgpu_plugin.node.host.atomicfile import TMP_MARK
from vgpu_plugin.node.ledger.state import JOURNAL_FILE_NAME, AllocationStore
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, short_tmp_dir
from vgpu_plugin.sim.simgpu import Node

RES = "nvidia.com/gpu"


@dataclass
class Serve:
    node: Node
    kubelet: KubeletEmulator
    plugin_dir: Path
    host_root: Path
    state_dir: Path
    log: Path
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        """Starts serve and waits until it registered."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.node.env(), stdout=out, stderr=out)
        self.starts += 1
        self.kubelet.wait_registrations(self.starts, timeout=30)
        self.kubelet.wait_devices(RES, lambda d: len(d) == 8, timeout=30)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def slices(self) -> list[str]:
        return [f"{g.uuid}-{k}" for g in self.node.gpus() for k in range(4)]


@pytest.fixture
def serve(simgpu_node: Node, native_tree: Path, tmp_path: Path) -> Iterator[Serve]:
    host_root = tmp_path / "host"
    install.install_shim(host_root, native_tree / "lib" / "libvgpu.so")
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nsharing: {{splitCount: 4}}\nhostRoot: {host_root}\n")
    plugin_dir = short_tmp_dir()
    argv = [
        sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(config),
        "--device-plugin-dir", str(plugin_dir), "--state-dir", str(tmp_path / "state"),
        "--lock-dir", str(tmp_path / "locks"), "--node-name", "node-1",
        "--metrics-address", "127.0.0.1:0", "--log-level", "info",
        "--pod-resources-socket", str(plugin_dir / "podres.sock"), "--cleanup-grace", "3600",
    ]  # fmt: skip
    s = Serve(
        simgpu_node, KubeletEmulator(plugin_dir), plugin_dir, host_root, tmp_path / "state",
        tmp_path / "plugin.log", argv,
    )  # fmt: skip
    s.kubelet.start()
    try:
        yield s
    finally:
        if s.proc is not None and s.proc.poll() is None:
            s.kill()
        s.kubelet.stop()


def check_written(serve: Serve, response: pb.ContainerAllocateResponse) -> str:
    """What Allocate answered is on the host: the limits file byte for byte, the region dir,
    the record. Returns the allocation id."""
    aid = response.envs["VGPU_ALLOCATION_ID"]
    wanted = _from_response(aid, response)
    assert wanted is not None
    assert Path(wanted.limits_path).read_bytes() == format_limits(wanted.limits).encode()
    assert Path(wanted.allocation_dir).is_dir()
    return aid


def check_nothing_torn(serve: Serve) -> None:
    """Every limits file there parses (a tmp file a kill left is not one)."""
    for path in (serve.host_root / "limits").iterdir():
        if TMP_MARK not in path.name:
            parse_limits(path.read_text())


@dataclass
class Caller:
    """Calls Allocate back to back from a thread; ``acked`` holds every answered container."""

    serve: Serve
    rng: random.Random
    acked: list[pb.ContainerAllocateResponse] = field(default_factory=list)
    in_flight: bool = False
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        slices = self.serve.slices()
        while not self.stop.is_set():
            containers = [self.rng.sample(slices, self.rng.choice([1, 2])) for _ in range(2)]
            self.in_flight = True
            try:
                response = self.serve.kubelet.allocate(RES, *containers)
            except grpc.RpcError:
                return  # the plugin died under this call: never acknowledged
            finally:
                self.in_flight = False
            self.acked.extend(response.container_responses)


def test_sigkill_during_allocates_loses_no_acknowledged_allocation_and_tears_nothing(
    serve: Serve,
) -> None:
    rng = random.Random(14)
    acked: list[pb.ContainerAllocateResponse] = []
    landed = 0  # kills that came while an Allocate was in flight
    round_ = 0
    # Rounds go on until enough kills landed and enough was answered: a loaded host answers
    # fewer calls in a round, so it takes more rounds, not a red test.
    while round_ < 4 or ((landed < 4 or len(acked) <= 20) and round_ < 20):
        round_ += 1
        serve.start()
        caller = Caller(serve, rng)
        thread = threading.Thread(target=caller.run)
        thread.start()
        # Each round has its calls answered before the kill may come (two containers each).
        deadline = time.monotonic() + 30
        while not caller.acked:
            assert time.monotonic() < deadline, "no Allocate answered within 30 s of a start"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.4))
        landed += caller.in_flight
        serve.kill()
        caller.stop.set()
        thread.join(30)
        acked += caller.acked
        # What the next start finds: every answered allocation's files and record.
        ids = {check_written(serve, r) for r in acked}
        check_nothing_torn(serve)
        store = AllocationStore(serve.state_dir)
        assert ids <= {r.allocation_id for r in store.all()}
        assert store.quarantined == []
        store.close()
    assert len(acked) > 20 and landed >= 4, f"{round_} rounds: {len(acked)} acked, {landed} landed"


def test_after_a_power_loss_serve_rebuilds_from_the_checkpoint_before_registering(
    serve: Serve,
) -> None:
    journal = serve.state_dir / JOURNAL_FILE_NAME
    serve.start()
    size = journal.stat().st_size
    slices = serve.slices()
    containers = [[slices[0]], [slices[5], slices[1]], [slices[7]]]
    response = serve.kubelet.allocate(RES, *containers)
    aids = [c.envs["VGPU_ALLOCATION_ID"] for c in response.container_responses]
    before = {
        str(p.relative_to(serve.host_root)): p.read_bytes() if p.is_file() else None
        for p in sorted(serve.host_root.rglob("*"))
        if "lib" not in p.parts
    }
    # The kubelet's checkpoint: the three containers, and one of ours it cannot rebuild from
    # (a response with our allocation id and nothing else).
    bogus = pb.ContainerAllocateResponse(envs={"VGPU_ALLOCATION_ID": "lost-one"})
    entries = [
        {"PodUID": "uid-1", "ContainerName": f"c{i}", "ResourceName": RES,
         "DeviceIDs": {"0": ids}, "AllocResp": base64.b64encode(r.SerializeToString()).decode()}
        for i, (r, ids) in enumerate(
            zip([*response.container_responses, bogus], [*containers, [slices[6]]], strict=True)
        )
    ]  # fmt: skip
    doc = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}
    (serve.plugin_dir / CHECKPOINT_NAME).write_text(json.dumps(doc))
    serve.kill()

    # The power loss: the journal's unsynced tail, two limits files (one torn: empty), a dir.
    os.truncate(journal, size)
    (serve.host_root / "limits" / aids[0]).unlink()
    (serve.host_root / "limits" / aids[1]).write_bytes(b"")
    (serve.host_root / "containers" / aids[2]).rmdir()
    # Without a reboot nothing is rebuilt: no write can have been lost, and what is missing
    # was removed on purpose (the kubelet's checkpoint may lag behind the cleanup).
    serve.start()
    assert not (serve.host_root / "limits" / aids[0]).exists()
    serve.kill()
    assert "rebuilt allocation" not in serve.log.read_text()
    # The node booted since: the boot the last start ran in is another one.
    (serve.state_dir / "boot_id").write_text("00000000-0000-0000-0000-000000000000\n")
    log_before = serve.log.read_text()
    serve.start()
    after = {
        str(p.relative_to(serve.host_root)): p.read_bytes() if p.is_file() else None
        for p in sorted(serve.host_root.rglob("*"))
        if "lib" not in p.parts
    }
    assert after == before
    records = {r.allocation_id: r for r in AllocationStore(serve.state_dir).all()}
    assert set(records) == set(aids)
    deadline = time.monotonic() + 30  # serve logs "registered" once the kubelet answered
    while "registered" not in serve.log.read_text()[len(log_before) :]:
        assert time.monotonic() < deadline, serve.log.read_text()
        time.sleep(0.05)
    lines = serve.log.read_text()[len(log_before) :].splitlines()
    rebuilt = [line for line in lines if "rebuilt allocation" in line]
    refused = [line for line in lines if "cannot rebuild allocation" in line]
    assert [next(a for a in aids if a in line) for line in rebuilt] == aids
    assert len(refused) == 1 and "lost-one" in refused[0]
    registered = next(i for i, line in enumerate(lines) if "registered" in line)
    assert all(lines.index(line) < registered for line in rebuilt + refused)
