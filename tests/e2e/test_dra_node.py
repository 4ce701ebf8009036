"""DRA end to end: a claim of 6 GiB and 30 % of one GPU becomes a runc container that the
shim holds to 6 GiB and 30 %, and two containers sharing the claim share those limits.

The claim goes the way the kubelet takes it: the DRA kubelet emulator prepares it over gRPC,
the driver reads its allocation from the (in-memory) API server and answers with CDI devices,
and the runtime (sim/toolkit.py) applies those CDI devices' specs to the container.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.helpers import NodeFactory, gpu_share, needs_containers, one

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core import dra
from vgpu_plugin.core.config import Config, DraConfig
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.kubelet.dra.driver import DraDriver
from vgpu_plugin.kubelet.dra.server import DraServer
from vgpu_plugin.node.host.install import installed_shim_version
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.sim.dra_kubelet import DraKubeletEmulator, FakeApiServer
from vgpu_plugin.sim.kubelet_emulator import short_tmp_dir
from vgpu_plugin.sim.node import MIB, WORKLOAD, Admitted, EmulatedNode

pytestmark = needs_containers


class DraOnNode:
    """The DRA driver beside an emulated node: same host root, shim, locks and CDI dir."""

    def __init__(self, node: EmulatedNode) -> None:
        self.node = node
        self.sockets = short_tmp_dir("dra-e2e-")
        (self.sockets / "registry").mkdir()
        self.api = FakeApiServer()
        gpus = [
            PhysicalGpu(s.index, s.uuid, s.name, s.total_memory, s.index, s.pci_bus_id, None)
            for s in node.node.gpus()
        ]
        config = Config(host_root=str(node.host_root), dra=DraConfig(enabled=True))
        self.driver = DraDriver(
            gpus, config, "node-1", ClaimLedger(AllocationStore(node.work / "dra-state")),
            self.api, self.api,
            installed_shim_version(node.host_root), lock_dir=str(node.lock_dir),
            cdi_spec_dir=str(node.cdi_dir),
        )  # fmt: skip
        self.server = DraServer(
            self.driver,
            self.sockets / "registry",
            self.sockets / "plugins",
            on_registered=lambda: self.driver.publish("registered"),
        )
        self.server.start()
        self.kubelet = DraKubeletEmulator(self.sockets / "registry", "node-1", self.api)
        self.kubelet.start()
        self.kubelet.wait_registered(dra.DRIVER_NAME)

    def claim(self, name: str, memory: str, compute: str) -> Admitted:
        """Create, allocate and prepare a claim; the pod's containers get its CDI devices."""
        self.api.add_claim("demo", name, {"gpu": {"memory": memory, "compute": compute}})
        (sl,) = self.api.slices.values()
        claim = self.api.allocate("demo", name, sl["spec"]["devices"][0]["name"])
        uid = claim["metadata"]["uid"]
        entry = self.kubelet.prepare(dra.DRIVER_NAME, claim).claims[uid]
        assert entry.error == ""
        names = [n for d in entry.devices for n in d.cdi_device_ids]
        response = pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name=n) for n in names])
        admitted = Admitted(name, [], response)
        self.node.admitted.append(admitted)  # so the node's stop() removes its containers
        return admitted

    def stop(self) -> None:
        self.kubelet.stop()
        self.server.stop()
        shutil.rmtree(self.sockets, ignore_errors=True)


@pytest.fixture
def dra_node(make_emulated_node: NodeFactory) -> Iterator[DraOnNode]:
    d = DraOnNode(make_emulated_node(memory_mib=16384))
    try:
        yield d
    finally:
        d.stop()


def test_a_6gi_30_percent_claim_is_held_to_6gi_and_30_percent(dra_node: DraOnNode) -> None:
    pod = dra_node.claim("infer", "6Gi", "30")
    seen = one(dra_node.node.run_container(pod, [*WORKLOAD, "view"]))
    assert seen["cuda_total"] == seen["nvml_total"] == 6144 * MIB
    got = one(dra_node.node.run_container(pod, [*WORKLOAD, "alloc", "--target-mib", "99999"]))
    assert got["out_of_memory"] and 6144 - 64 - 256 <= got["allocated_mib"] <= 6144 - 256
    t0 = time.monotonic_ns()
    proc = dra_node.node.start_container(pod, [*WORKLOAD, "compute", "--seconds", "4"])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # Judged by simgpu's record while it launched (a loaded host delays the launcher).
    share = gpu_share(dra_node.node, json.loads(out.strip().splitlines()[-1]), t0, 30)
    assert share.held, share


def test_two_containers_sharing_a_claim_share_its_memory(dra_node: DraOnNode) -> None:
    pod = dra_node.claim("pair", "4Gi", "50")
    first = dra_node.node.start_container(
        pod, [*WORKLOAD, "alloc", "--target-mib", "3072", "--hold", "600"]
    )
    try:
        # The first container holds 3 GiB + its context once it says so (its line, not a
        # sleep: a loaded host starts it late), and until it is killed.
        assert first.stdout is not None
        assert json.loads(first.stdout.readline())["allocated_mib"] == 3072
        second = one(
            dra_node.node.run_container(pod, [*WORKLOAD, "alloc", "--target-mib", "99999"])
        )
        # One region, one limit: the second container gets what the first left of 4 GiB.
        assert second["allocated_mib"] <= 4096 - 3072 - 2 * 256
    finally:
        dra_node.node.runtime.kill(pod.containers[0])
        first.communicate(timeout=60)
    assert len(list(Path(dra_node.node.host_root, "containers").glob("dra-*"))) == 1
