"""The DRA driver fails closed (issue 26): over real gRPC, with the kubelet emulator and an
API server in memory, a result without the capacities the ResourceSlice requires is refused, a claim
that would overcommit a GPU is refused naming both numbers, and amounts only round up."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet.test_dra_driver import DEV_A, DRIVER, Node, make_driver, start_server

from vgpu_plugin.core.devices import MIB
from vgpu_plugin.core.limits import parse_limits
from vgpu_plugin.kubelet import peers
from vgpu_plugin.sim.dra_kubelet import DraKubeletEmulator, FakeApiServer
from vgpu_plugin.sim.kubelet_emulator import short_tmp_dir


@pytest.fixture
def dra_node() -> Iterator[Node]:
    root = short_tmp_dir("dra-")
    (root / "registry").mkdir()
    api = FakeApiServer()
    driver = make_driver(root, api)
    server = start_server(root, driver)
    kubelet = DraKubeletEmulator(root / "registry", "node-a", api)
    kubelet.start()
    try:
        kubelet.wait_registered(DRIVER)
        assert server.wait_registered(5)
        yield Node(root, api, kubelet, server, driver)
    finally:
        kubelet.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def allocated(node: Node, name: str, caps: dict[str, str]) -> dict[str, Any]:
    """A claim the (emulated) scheduler allocated on GPU A; it keeps no sums across claims,
    as a buggy scheduler or one with consumable capacity off would not."""
    node.api.add_claim("ml", name, {"gpu": caps})
    return node.api.allocate("ml", name, DEV_A)


def limits_files(node: Node) -> list[Path]:
    d = node.host_root / "limits"
    return sorted(d.iterdir()) if d.is_dir() else []


def prepare_error(node: Node, claim: dict[str, Any]) -> str:
    resp = node.kubelet.prepare(DRIVER, claim)
    return str(resp.claims[claim["metadata"]["uid"]].error)


def test_a_result_without_consumed_capacity_is_refused_not_prepared_as_the_whole_gpu(
    dra_node: Node,
) -> None:
    claim = allocated(dra_node, "bare", {"memory": "6Gi"})
    stored = dra_node.api.claims[("ml", "bare")]
    del stored["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]
    error = prepare_error(dra_node, claim)
    assert "no consumedCapacity 'memory'" in error and "\n" not in error
    assert limits_files(dra_node) == [] and dra_node.driver.prepared() == []


def test_two_claims_promising_more_than_the_gpu_has_are_not_both_prepared(
    dra_node: Node,
) -> None:
    first = allocated(dra_node, "first", {"memory": "12Gi", "compute": "30"})
    second = allocated(dra_node, "second", {"memory": "12Gi", "compute": "30"})
    assert prepare_error(dra_node, first) == ""
    error = prepare_error(dra_node, second)
    assert "has 16Gi of memory; prepared claims promise 12Gi and this one asks 12Gi" in error
    assert len(limits_files(dra_node)) == 1 and len(dra_node.driver.prepared()) == 1
    # Once the first is gone the second fits, and the kubelet's retry prepares it.
    dra_node.kubelet.unprepare(DRIVER, first)
    assert prepare_error(dra_node, second) == ""
    # A retry of a prepared claim is not counted against itself.
    assert prepare_error(dra_node, second) == ""


def test_compute_promised_beyond_100_percent_is_refused(dra_node: Node) -> None:
    first = allocated(dra_node, "first", {"memory": "1Gi", "compute": "70"})
    second = allocated(dra_node, "second", {"memory": "1Gi", "compute": "31"})
    assert prepare_error(dra_node, first) == ""
    assert "prepared claims promise 70% and this one asks 31%" in prepare_error(dra_node, second)


def test_a_fractional_amount_rounds_up_to_the_policys_step(dra_node: Node) -> None:
    claim = allocated(dra_node, "odd", {})
    stored = dra_node.api.claims[("ml", "odd")]
    stored["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = {
        "memory": "1.5",
        "compute": "12.5",
    }
    assert prepare_error(dra_node, claim) == ""
    (g,) = parse_limits(limits_files(dra_node)[0].read_text()).gpus
    assert (g.memory_bytes, g.compute_percent) == (1024 * MIB, 13)  # the 1Gi minimum


def test_refused_claims_are_counted_and_logged_at_a_bounded_rate(
    dra_node: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    errors = peers.PeerErrors()
    monkeypatch.setattr(peers, "PEER_ERRORS", errors)
    caplog.set_level(logging.DEBUG)
    pending = [dra_node.api.add_claim("ml", f"p{k}", {"gpu": {}}) for k in range(20)]
    resp = dra_node.kubelet.prepare(DRIVER, *pending)
    assert all("is not allocated" in resp.claims[c["metadata"]["uid"]].error for c in pending)
    lines = [r for r in caplog.records if "is not allocated" in r.getMessage()]
    assert len(lines) == 5  # before: one line per claim, whoever asked
    assert errors.count(peers.INVALID_REQUEST) == 20
