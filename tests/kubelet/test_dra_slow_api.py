"""NodePrepareResources under a slow or absent API server (issue 26): every claim is answered
before the kubelet's deadline, with an error it retries while the prepare goes on; the queue
is bounded; unprepares and registration keep their threads; a prepare never lands after the
claim's unprepare."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubelet.test_dra_driver import DEV_A, GPUS

from vgpu_plugin.api.dra.v1 import api_pb2 as v1
from vgpu_plugin.api.dra.v1 import api_pb2_grpc as v1_grpc
from vgpu_plugin.api.pluginregistration.v1 import api_pb2 as reg
from vgpu_plugin.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vgpu_plugin.core import dra
from vgpu_plugin.core.config import Config, DraConfig
from vgpu_plugin.kubelet import peers
from vgpu_plugin.kubelet.dra.driver import DraDriver
from vgpu_plugin.kubelet.dra.server import DraServer
from vgpu_plugin.kubelet.peers import PeerErrors
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.sim.dra_kubelet import FakeApiServer
from vgpu_plugin.sim.kubelet_emulator import short_tmp_dir

# The kubelet waits 45 s for a DRA call; these tests scale that down. A call answered at all
# within its deadline is what they check, never how fast.
DEADLINE_S = 8.0
SHORT_DEADLINE_S = 4.0
SETTLE_S = 60.0  # for background work to finish on a loaded machine


class GatedApi:
    """The API server, with claim reads that hang until the test opens the gate."""

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.gate = threading.Event()
        self.reads = 0
        self._lock = threading.Lock()

    def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        with self._lock:
            self.reads += 1
        self.gate.wait(SETTLE_S)  # bounded, so a failing test still ends
        return self.api.get_claim(namespace, name)


@dataclass
class Node:
    root: Path
    api: FakeApiServer
    gated: GatedApi
    driver: DraDriver
    server: DraServer

    def claim(self, name: str) -> dict[str, Any]:
        self.api.add_claim("ml", name, {"gpu": {"memory": "1Gi", "compute": "1"}})
        return self.api.allocate("ml", name, DEV_A)

    def stub(self) -> tuple[grpc.Channel, Any]:
        channel = grpc.insecure_channel(f"unix://{self.server.service_socket}")
        return channel, v1_grpc.DRAPluginStub(channel)  # type: ignore[no-untyped-call]

    def prepare(self, *claims: Mapping[str, Any], timeout: float = DEADLINE_S) -> dict[str, Any]:
        channel, stub = self.stub()
        with channel:
            resp = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref(c) for c in claims]), timeout=timeout
            )
        return {uid: resp.claims[uid] for uid in resp.claims}

    def unprepare(self, *claims: Mapping[str, Any], timeout: float = DEADLINE_S) -> dict[str, Any]:
        channel, stub = self.stub()
        with channel:
            resp = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[ref(c) for c in claims]), timeout=timeout
            )
        return {uid: resp.claims[uid] for uid in resp.claims}

    def prepared_uids(self) -> set[str]:
        return {c.uid for c in self.driver.prepared()}


def ref(claim: Mapping[str, Any]) -> Any:
    m = claim["metadata"]
    return v1.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])


def uid(claim: Mapping[str, Any]) -> str:
    return str(claim["metadata"]["uid"])


def eventually(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def errors(monkeypatch: pytest.MonkeyPatch) -> PeerErrors:
    fresh = PeerErrors()
    monkeypatch.setattr(peers, "PEER_ERRORS", fresh)
    return fresh


def make_node(**server_args: Any) -> Node:
    root = short_tmp_dir("dra-")
    (root / "registry").mkdir()
    api = FakeApiServer()
    gated = GatedApi(api)
    config = Config(host_root=str(root / "vgpu"), dra=DraConfig(enabled=True))
    driver = DraDriver(
        GPUS, config, "node-a", ClaimLedger(AllocationStore(root / "state")), gated, api,
        "0.1.0-abc", lock_dir=str(root / "locks"), cdi_spec_dir=str(root / "cdi"),
    )  # fmt: skip
    driver.publish("test")
    server = DraServer(
        driver, root / "registry", root / "plugins", poll_interval=0.1, **server_args
    )
    server.start()
    return Node(root, api, gated, driver, server)


@pytest.fixture
def node_factory() -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def factory(**server_args: Any) -> Node:
        made.append(make_node(**server_args))
        return made[-1]

    yield factory
    for n in made:
        n.gated.gate.set()
        n.server.stop()
        # the prepares the gate let go run on (stop leaves them to end on their threads):
        # their files must not vanish under them (at load 15 one logged after the test ended)
        assert eventually(lambda n=n: n.server.queue.in_flight() == 0)
        shutil.rmtree(n.root, ignore_errors=True)


def test_a_claim_is_answered_before_the_deadline_while_the_api_server_hangs(
    node_factory: Callable[..., Node], errors: PeerErrors, caplog: pytest.LogCaptureFixture
) -> None:
    node = node_factory()
    claim = node.claim("slow")
    # Before: the call waited on the claim read past the kubelet's deadline.
    entry = node.prepare(claim)[uid(claim)]
    assert "ml/slow is still being prepared" in entry.error and "retry" in entry.error
    assert list(entry.devices) == []
    # A retry while it still hangs: the same answer, the same one job, no second line.
    again = node.prepare(claim, timeout=SHORT_DEADLINE_S)[uid(claim)]
    assert again.error == entry.error and node.server.queue.in_flight() == 1
    assert len([r for r in caplog.records if "still being prepared" in r.getMessage()]) == 1
    # The prepare went on; once the API server answers, the kubelet's retry gets the result
    # from the record, without reading the claim again.
    node.gated.gate.set()
    assert eventually(lambda: node.prepared_uids() == {uid(claim)})
    entry = node.prepare(claim)[uid(claim)]
    assert entry.error == "" and entry.devices[0].device_name == DEV_A
    assert node.gated.reads == 1


def test_the_queue_is_bounded_and_a_full_queue_refuses_at_once(
    node_factory: Callable[..., Node], errors: PeerErrors
) -> None:
    node = node_factory(prepare_workers=1, queue_capacity=2)
    claims = [node.claim(f"c{k}") for k in range(4)]
    answers = node.prepare(*claims, timeout=SHORT_DEADLINE_S)
    still = [u for u, e in answers.items() if "still being prepared" in e.error]
    full = [
        u for u, e in answers.items() if "2 claims are being prepared, the queue's limit" in e.error
    ]
    assert (len(still), len(full)) == (2, 2)
    assert errors.count(peers.PREPARE_QUEUE_FULL) == 2
    # Asking again for claims in flight takes no more room: one job per claim.
    again = node.prepare(*claims[:2], timeout=SHORT_DEADLINE_S)
    assert node.server.queue.in_flight() == 2 and len(again) == 2
    node.gated.gate.set()
    assert eventually(lambda: node.server.queue.in_flight() == 0)
    # The kubelet's retries prepare the rest.
    assert eventually(lambda: all(e.error == "" for e in node.prepare(*claims).values()))
    assert node.prepared_uids() == {uid(c) for c in claims}


def test_registration_and_unprepare_keep_threads_while_prepares_hang(
    node_factory: Callable[..., Node], errors: PeerErrors
) -> None:
    node = node_factory()
    claims = [node.claim(f"h{k}") for k in range(12)]
    answered: list[str] = []
    callers = [
        threading.Thread(target=lambda c=c: answered.append(node.prepare(c)[uid(c)].error))
        for c in claims
    ]
    for t in callers:
        t.start()
    try:
        assert eventually(lambda: node.server.queue.in_flight() == len(claims))
        # Before: 8 hung prepares held all 8 threads, and the kubelet's plugin watcher could
        # not even ask GetInfo.
        with grpc.insecure_channel(f"unix://{node.server.registration_socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            info = stub.GetInfo(reg.InfoRequest(), timeout=SHORT_DEADLINE_S)
        assert info.type == dra.PLUGIN_TYPE
        other = node.claim("never-prepared")
        assert node.unprepare(other, timeout=SHORT_DEADLINE_S)[uid(other)].error == ""
    finally:
        for t in callers:
            t.join(SETTLE_S)
    assert len(answered) == len(claims)
    assert all("still being prepared" in e for e in answered)


def test_a_claim_unprepared_while_its_prepare_waits_is_never_prepared(
    node_factory: Callable[..., Node], errors: PeerErrors
) -> None:
    node = node_factory(prepare_workers=1)
    first, second = node.claim("first"), node.claim("second")
    answers = node.prepare(first, second, timeout=SHORT_DEADLINE_S)
    assert all("still being prepared" in e.error for e in answers.values())
    # ``second`` waits behind ``first``: its unprepare drops it from the queue.
    assert node.unprepare(second, timeout=SHORT_DEADLINE_S)[uid(second)].error == ""
    # ``first`` is running: its unprepare cannot remove what is not there yet, so it says
    # so, and the kubelet retries.
    error = node.unprepare(first, timeout=SHORT_DEADLINE_S)[uid(first)].error
    assert "ml/first is still being prepared; retry" in error
    node.gated.gate.set()
    assert eventually(lambda: node.server.queue.in_flight() == 0)
    assert node.prepared_uids() == {uid(first)}
    assert node.unprepare(first)[uid(first)].error == ""
    assert node.prepared_uids() == set()
    assert not (node.root / "vgpu" / "limits" / f"dra-{uid(second)}").exists()
