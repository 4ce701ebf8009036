"""The DRA driver over real gRPC, driven by the DRA kubelet emulator and an API server in
memory: registration, the ResourceSlice and its republishing, NodePrepareResources (v1 and
v1beta1) and its idempotence across retries and restarts, NodeUnprepareResources."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from core.test_cdi import validator

from vgpu_plugin.core import dra
from vgpu_plugin.core.config import Config, DraConfig
from vgpu_plugin.core.devices import MIB, PhysicalGpu
from vgpu_plugin.core.limits import parse_limits
from vgpu_plugin.kubelet.dra.driver import DraDriver
from vgpu_plugin.kubelet.dra.server import DraServer
from vgpu_plugin.kubelet.watch import file_id
from vgpu_plugin.node.host.atomicfile import DeferredSync
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.sim.dra_kubelet import DraKubeletEmulator, FakeApiServer
from vgpu_plugin.sim.kubelet_emulator import short_tmp_dir

GIB = 1 << 30
AAAA = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
BBBB = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
GPUS = (
    PhysicalGpu(0, AAAA, "NVIDIA A100-SXM4-16GB", 16 * GIB, 0, "", 0),
    PhysicalGpu(1, BBBB, "NVIDIA A100-SXM4-16GB", 16 * GIB, 1, "", 0),
)
DEV_A = "gpu-aaaaaaaa-1111-2222-3333-444444444444"
DRIVER = dra.DRIVER_NAME


@dataclass
class Node:
    root: Path
    api: FakeApiServer
    kubelet: DraKubeletEmulator
    server: DraServer
    driver: DraDriver

    @property
    def host_root(self) -> Path:
        return self.root / "vgpu"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"


def make_driver(root: Path, api: FakeApiServer, syncer: DeferredSync | None = None) -> DraDriver:
    """syncer: as serve runs it (files synced after the answer); None: all synced before."""
    config = Config(host_root=str(root / "vgpu"), dra=DraConfig(enabled=True))
    return DraDriver(
        GPUS,
        config,
        "node-a",
        ClaimLedger(AllocationStore(root / "state")),
        api,
        api,
        "0.1.0-abc",
        facts={g.uuid: dra.DeviceFacts("8.0", "550.54.15") for g in GPUS},
        lock_dir=str(root / "locks"),
        cdi_spec_dir=str(root / "cdi"),
        syncer=syncer,
    )


def start_server(root: Path, driver: DraDriver) -> DraServer:
    server = DraServer(
        driver,
        root / "registry",
        root / "plugins",
        on_registered=lambda: driver.publish("registered"),
        poll_interval=0.1,
    )
    server.start()
    return server


@pytest.fixture
def node() -> Iterator[Node]:
    root = short_tmp_dir("dra-")
    (root / "registry").mkdir()
    api = FakeApiServer()
    driver = make_driver(root, api)
    server = start_server(root, driver)
    kubelet = DraKubeletEmulator(root / "registry", "node-a", api)
    kubelet.start()
    node = Node(root, api, kubelet, server, driver)
    try:
        kubelet.wait_registered(DRIVER)
        assert server.wait_registered(5)
        yield node
    finally:
        kubelet.stop()
        node.server.stop()  # the one serving now: a test may have replaced it
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_the_driver_registers_and_publishes_its_slice(node: Node) -> None:
    reg = node.kubelet.drivers[DRIVER]
    assert reg.endpoint == str(node.root / "plugins" / DRIVER / "dra.sock")
    assert set(reg.versions) == {"v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"}
    (s,) = node.api.slices.values()
    assert [d["name"] for d in s["spec"]["devices"]] == [DEV_A, DEV_A.replace("aaaaaaaa", "b" * 8)]


def test_the_slice_is_owned_by_its_node_and_goes_with_it(tmp_path: Path) -> None:
    api = FakeApiServer()
    driver = make_driver(tmp_path, api)
    api.fail_node_reads = True
    assert not driver.publish("started")  # no owner known: no slice without one
    assert api.slices == {}
    api.fail_node_reads = False
    assert driver.publish("retry") and driver.publish("again")
    assert api.node_reads == 2  # the UID is read once, then remembered
    (s,) = api.slices.values()
    assert s["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": api.nodes["node-a"]}
    ]
    api.delete_node("node-a")
    assert api.slices == {}


def test_a_kubelet_restart_gets_the_slice_published_again(node: Node) -> None:
    before = node.api.publishes
    node.kubelet.restart()  # deletes the node's slices, as the kubelet does at start
    node.kubelet.wait_registered(DRIVER)
    assert node.server.registrations == 2
    assert node.api.publishes > before and len(node.api.slices) == 1


def test_a_slice_deleted_after_registration_is_published_again(node: Node) -> None:
    """A real kubelet 1.36 may delete its node's ResourceSlices after a restart once the
    driver has registered and published again (seen in the cluster tier): the driver's
    periodic check (serve: every SLICE_CHECK_INTERVAL_S) brings the slice back."""
    before = node.api.publishes
    assert not node.driver.keep_published()  # there: nothing to do, nothing published
    assert node.api.publishes == before
    (name,) = node.api.slices
    node.api.delete(name)
    assert node.driver.keep_published()
    assert list(node.api.slices) == [name] and node.api.publishes == before + 1
    assert not node.driver.keep_published()


def test_an_unhealthy_gpu_is_tainted_no_schedule_and_comes_back(node: Node) -> None:
    node.driver.apply_health(AAAA, healthy=False)
    (s,) = node.api.slices.values()
    taints = {d["attributes"]["uuid"]["string"]: d.get("taints") for d in s["spec"]["devices"]}
    assert taints == {
        AAAA: [{"key": "vgpu-plugin.io/unhealthy", "value": "true", "effect": "NoSchedule"}],
        BBBB: None,
    }
    node.api.add_claim("ml", "infer", {"gpu": {}})
    with pytest.raises(LookupError, match="untainted"):  # the scheduler keeps off it
        node.api.allocate("ml", "infer", DEV_A)
    generation = s["spec"]["pool"]["generation"]
    node.driver.apply_health(AAAA, healthy=True)
    (s,) = node.api.slices.values()
    assert not any("taints" in d for d in s["spec"]["devices"])
    assert s["spec"]["pool"]["generation"] > generation
    node.api.allocate("ml", "infer", DEV_A)


def test_without_device_taints_an_unhealthy_gpu_leaves_the_slice(node: Node) -> None:
    node.api.device_taints = False  # the API server drops them: DRADeviceTaints off
    node.driver.apply_health(AAAA, healthy=False)
    (s,) = node.api.slices.values()
    assert [d["attributes"]["uuid"]["string"] for d in s["spec"]["devices"]] == [BBBB]
    publishes = node.api.publishes
    node.driver.apply_health(BBBB, healthy=False)  # known now: left out at the first try
    assert node.api.publishes == publishes + 1
    (s,) = node.api.slices.values()
    assert s["spec"]["devices"] == []
    node.driver.apply_health(AAAA, healthy=True)
    node.driver.apply_health(BBBB, healthy=True)
    (s,) = node.api.slices.values()
    assert len(s["spec"]["devices"]) == 2


def test_an_old_plugin_stopping_leaves_the_newer_ones_sockets(node: Node) -> None:
    """A rolling update: the new pod serves the same paths while the old one still runs;
    the old one's stop must not delete the new one's sockets."""
    old = node.server
    newer_root = node.root / "newer"
    newer_root.mkdir()
    node.server = start_server(node.root, make_driver(newer_root, node.api))
    sockets = (node.server.service_socket, node.server.registration_socket)
    ids = [file_id(p) for p in sockets]
    assert None not in ids
    old.stop()
    assert [file_id(p) for p in sockets] == ids  # the same files: not deleted, not re-served
    node.kubelet.restart()  # a kubelet finds the newer one and prepares through it
    node.kubelet.wait_registered(DRIVER)
    assert node.server.wait_registered(5)
    claim = claim_6g_30(node)
    entry = node.kubelet.prepare(DRIVER, claim).claims[claim["metadata"]["uid"]]  # type: ignore[index]
    assert entry.error == "" and len(entry.devices) == 1


def claim_6g_30(node: Node) -> dict[str, object]:
    node.api.add_claim("ml", "infer", {"gpu": {"memory": "6Gi", "compute": "30"}})
    return node.api.allocate("ml", "infer", DEV_A)


def test_a_6gi_30_percent_claim_becomes_a_cdi_device_with_its_limits(node: Node) -> None:
    claim = claim_6g_30(node)
    uid = claim["metadata"]["uid"]  # type: ignore[index]
    resp = node.kubelet.prepare(DRIVER, claim)
    entry = resp.claims[uid]
    assert entry.error == ""
    (device,) = entry.devices
    aid = f"dra-{uid}"
    assert list(device.cdi_device_ids) == [
        f"nvidia.com/gpu={AAAA}",
        f"vgpu-plugin/allocation={aid}",
    ]
    assert (device.pool_name, device.device_name, list(device.request_names)) == (
        "node-a",
        DEV_A,
        ["gpu"],
    )
    result = claim["status"]["allocation"]["devices"]["results"][0]  # type: ignore[index]
    assert device.share_id == result["shareID"]
    limits = parse_limits((node.host_root / "limits" / aid).read_text())
    assert [(g.uuid, g.memory_bytes, g.compute_percent) for g in limits.gpus] == [
        (AAAA, 6 * GIB, 30)
    ]
    assert (node.host_root / "containers" / aid).is_dir()
    spec = json.loads((node.cdi_dir / f"vgpu-plugin-allocation_{aid}.json").read_text())
    validator().validate(spec)
    mounts = {
        m["containerPath"]: m["hostPath"] for m in spec["devices"][0]["containerEdits"]["mounts"]
    }
    assert mounts["/etc/vgpu/limits"] == str(node.host_root / "limits" / aid)
    assert mounts["/tmp/vgpu"] == str(node.host_root / "containers" / aid)


@pytest.mark.parametrize("where", ["request", "result"])
def test_an_admin_access_claim_is_refused_naming_the_claim_and_why(node: Node, where: str) -> None:
    node.api.add_claim("ml", "watch", {"gpu": {}})
    if where == "request":
        request = node.api.claims[("ml", "watch")]["spec"]["devices"]["requests"][0]
        request["exactly"]["adminAccess"] = True
    claim = node.api.allocate("ml", "watch", DEV_A)
    if where == "result":
        stored = node.api.claims[("ml", "watch")]
        stored["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
        claim = stored
    uid = claim["metadata"]["uid"]
    entry = node.kubelet.prepare(DRIVER, claim).claims[uid]
    assert entry.error == (
        f"claim ml/watch: request gpu asks adminAccess to device {DEV_A}; driver {DRIVER}"
        " grants only limited shares of a GPU and offers no admin (monitoring) access"
    )
    assert not list(entry.devices)
    # Nothing was prepared: no limits, no CDI spec, no record.
    assert not (node.host_root / "limits" / f"dra-{uid}").exists()
    assert not list(node.cdi_dir.glob(f"*{uid}*"))
    assert node.driver.prepared() == []


def test_prepare_is_idempotent_across_retries_and_plugin_restarts(node: Node) -> None:
    claim = claim_6g_30(node)
    first = node.kubelet.prepare(DRIVER, claim)
    again = node.kubelet.prepare(DRIVER, claim)
    assert first == again and node.api.claim_reads == 1
    # A restarted plugin answers from its record, even while the API server does not answer.
    node.server.stop()
    node.api.fail_reads = True
    driver = make_driver(node.root, node.api)
    node.server = start_server(node.root, driver)
    node.kubelet.restart()
    node.kubelet.wait_registered(DRIVER)
    assert node.kubelet.prepare(DRIVER, claim) == first


def test_a_result_without_a_share_id_answers_none(node: Node) -> None:
    claim = claim_6g_30(node)
    uid = claim["metadata"]["uid"]  # type: ignore[index]
    stored = node.api.claims[("ml", "infer")]
    del stored["status"]["allocation"]["devices"]["results"][0]["shareID"]
    (device,) = node.kubelet.prepare(DRIVER, claim).claims[uid].devices
    assert not device.HasField("share_id")  # absent, as upstream's optional field, not ""
    assert device.device_name == DEV_A


def test_v1beta1_prepares_the_same_devices_without_a_share_id(node: Node) -> None:
    claim = claim_6g_30(node)
    uid = claim["metadata"]["uid"]  # type: ignore[index]
    (device,) = node.kubelet.prepare(DRIVER, claim, version="v1beta1").claims[uid].devices
    assert device.device_name == DEV_A and len(device.cdi_device_ids) == 2


def test_unprepare_removes_the_claims_files_and_record(node: Node) -> None:
    claim = claim_6g_30(node)
    uid = claim["metadata"]["uid"]  # type: ignore[index]
    node.kubelet.prepare(DRIVER, claim)
    resp = node.kubelet.unprepare(DRIVER, claim)
    assert resp.claims[uid].error == ""
    aid = f"dra-{uid}"
    assert not (node.host_root / "limits" / aid).exists()
    assert not (node.host_root / "containers" / aid).exists()
    assert list(node.cdi_dir.glob("*.json")) == []
    assert node.driver.prepared() == []
    # Again, and a claim never prepared: both fine, as the kubelet retries.
    assert node.kubelet.unprepare(DRIVER, claim).claims[uid].error == ""


def test_a_claim_that_cannot_be_prepared_fails_alone_in_one_line(node: Node) -> None:
    good = claim_6g_30(node)
    bad = node.api.add_claim("ml", "pending", {"gpu": {"memory": "1Gi"}})  # not allocated
    resp = node.kubelet.prepare(DRIVER, good, bad)
    assert resp.claims[good["metadata"]["uid"]].error == ""  # type: ignore[index]
    error = resp.claims[bad["metadata"]["uid"]].error
    assert "ml/pending is not allocated" in error and "\n" not in error
    node.api.fail_reads = True
    late = node.api.add_claim("ml", "late", {"gpu": {}})
    error = node.kubelet.prepare(DRIVER, late).claims[late["metadata"]["uid"]].error
    assert "cannot read claim ml/late" in error
    assert list((node.host_root / "limits").iterdir()) == [
        node.host_root / "limits" / f"dra-{good['metadata']['uid']}"  # type: ignore[index]
    ]


def test_two_containers_sharing_a_claim_get_one_region(node: Node) -> None:
    claim = claim_6g_30(node)
    uid = claim["metadata"]["uid"]  # type: ignore[index]
    # The kubelet prepares a claim once per pod and gives each container that names it the
    # same CDI devices: one limits file, one region.
    (device,) = node.kubelet.prepare(DRIVER, claim).claims[uid].devices
    assert len(list((node.host_root / "containers").iterdir())) == 1
    assert device.cdi_device_ids[-1] == f"vgpu-plugin/allocation=dra-{uid}"


def test_a_claim_on_another_nodes_device_is_refused(node: Node) -> None:
    node.api.add_claim("ml", "elsewhere", {"gpu": {}})
    claim = node.api.allocate("ml", "elsewhere", DEV_A)
    claim["status"]["allocation"]["devices"]["results"][0]["pool"] = "node-b"
    node.api.claims[("ml", "elsewhere")] = claim
    error = node.kubelet.prepare(DRIVER, claim).claims[claim["metadata"]["uid"]].error
    assert "is not one of node node-a's" in error


def test_default_capacity_when_the_claim_asks_for_none(node: Node) -> None:
    node.api.add_claim("ml", "small", {"gpu": {}})
    claim = node.api.allocate("ml", "small", DEV_A)
    node.kubelet.prepare(DRIVER, claim)
    aid = f"dra-{claim['metadata']['uid']}"
    (g,) = parse_limits((node.host_root / "limits" / aid).read_text()).gpus
    assert (g.memory_bytes, g.compute_percent) == (GIB, 10)
    assert MIB  # the policy's defaults: 1Gi and 10 %
