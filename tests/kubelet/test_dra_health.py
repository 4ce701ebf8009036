"""The DRA driver's device health streams (``v1alpha1.DRAResourceHealth``) over real gRPC on
the driver's socket, read as the kubelet reads them (the DRA kubelet emulator's client)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from kubelet.test_dra_driver import AAAA, BBBB, DEV_A, DRIVER, Node, claim_6g_30
from kubelet.test_dra_driver import node as node  # the fixture

from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2 as health_pb
from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from vgpu_plugin.kubelet.dra.health import (
    MAX_STREAMS,
    TIMEOUT_S,
    DeviceHealth,
    HealthStreams,
)
from vgpu_plugin.sim.dra_kubelet import HealthWatch

DEV_B = DEV_A.replace("aaaaaaaa", "b" * 8)
A, B = f"node-a/{DEV_A}", f"node-a/{DEV_B}"


@pytest.fixture
def watch(node: Node) -> Iterator[HealthWatch]:
    w = node.kubelet.watch_health(DRIVER)
    try:
        yield w
    finally:
        w.close()


def _latest_is(expected: dict[str, str]) -> Any:
    return lambda w: {k: v[0] for k, v in w.health().items()} == expected


def test_a_new_stream_gets_every_device_healthy_at_once(watch: HealthWatch) -> None:
    watch.wait_for("first list", lambda w: len(w.messages) >= 1)
    first = watch.messages[0]
    assert [(d.device.pool_name, d.device.device_name) for d in first.devices] == [
        ("node-a", DEV_A),
        ("node-a", DEV_B),
    ]
    assert watch.health() == {A: ("HEALTHY", ""), B: ("HEALTHY", "")}
    assert {d.health_check_timeout_seconds for d in first.devices} == {TIMEOUT_S}
    assert all(d.last_updated_time > 1_700_000_000 for d in first.devices)  # unix seconds


def test_an_unhealthy_gpu_is_sent_unhealthy_then_healthy_again(
    node: Node,
    watch: HealthWatch,
) -> None:
    watch.wait_for("first list", lambda w: len(w.messages) >= 1)
    node.driver.apply_health(AAAA, healthy=False)
    watch.wait_for("A unhealthy", _latest_is({A: "UNHEALTHY", B: "HEALTHY"}))
    assert AAAA in watch.health()[A][1]  # the message names the GPU
    node.driver.apply_health(AAAA, healthy=True)
    watch.wait_for("A healthy again", _latest_is({A: "HEALTHY", B: "HEALTHY"}))
    assert watch.health()[A][1] == ""


def test_the_service_is_advertised_and_a_stream_ends_cleanly_on_stop(
    node: Node,
    watch: HealthWatch,
) -> None:
    assert "v1alpha1.DRAResourceHealth" in node.kubelet.drivers[DRIVER].versions
    watch.wait_for("first list", lambda w: len(w.messages) >= 1)
    node.server.stop()
    watch.wait_for("end", lambda w: w.ended is not None)
    assert watch.ended == "ok"  # ended by the driver, not cancelled nor failed


def test_streams_that_do_not_read_never_stall_health_changes_or_prepares(
    node: Node,
) -> None:
    """Clients that open streams and never read: the streams beyond the bound end (oldest
    first), a flapping GPU's changes never wait on them, prepares still get threads, and the
    next stream (the kubelet's new one) gets the latest health."""
    channel = grpc.insecure_channel(f"unix://{node.server.service_socket}")
    stub = health_grpc.DRAResourceHealthStub(channel)  # type: ignore[no-untyped-call]
    silent = [
        stub.NodeWatchResources(health_pb.NodeWatchResourcesRequest())
        for _ in range(10)  # more than the server has threads for calls
    ]
    try:
        wait_for("the silent streams to open", lambda: node.server.health.sent >= MAX_STREAMS)
        for i in range(200):
            node.driver.apply_health(BBBB, healthy=i % 2 == 1)
        claim = claim_6g_30(node)
        entry = node.kubelet.prepare(DRIVER, claim).claims[claim["metadata"]["uid"]]  # type: ignore[index]
        assert entry.error == "" and len(entry.devices) == 1
        assert node.server.health.open_streams <= MAX_STREAMS
        latest = node.kubelet.watch_health(DRIVER)
        try:
            latest.wait_for("the latest health", _latest_is({A: "HEALTHY", B: "HEALTHY"}))
        finally:
            latest.close()
    finally:
        for call in silent:
            call.cancel()
        channel.close()


def wait_for(what: str, check: Any, timeout: float = 30.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if check():
            return
        done.wait(0.01)
    raise TimeoutError(f"no {what} in {timeout}s")


class _Context:
    """What a stream needs of gRPC's servicer context: the callback on the client's end, and
    the cancel of a replaced stream."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)


def test_changes_while_a_stream_is_busy_coalesce_into_the_latest_list() -> None:
    state = {"healthy": True}
    streams = HealthStreams(
        lambda: [DeviceHealth("n", "d", state["healthy"])], refresh_s=3600, clock=lambda: 1e9
    )
    stream = streams.watch(_Context())
    first = next(stream)
    assert [d.health for d in first.devices] == [1] and first.devices[0].last_updated_time == 10**9
    for i in range(100):  # the reader is busy: nothing queues up
        state["healthy"] = i % 2 == 0
        streams.changed()
    latest = next(stream)
    assert [d.health for d in latest.devices] == [2]  # the last change: unhealthy
    assert streams.sent == 2
    stream.close()
    assert streams.open_streams == 0


def test_a_quiet_stream_is_refreshed_before_the_kubelet_times_it_out() -> None:
    streams = HealthStreams(lambda: [DeviceHealth("n", "d", True)], refresh_s=0.01)
    stream = streams.watch(None)
    next(stream)
    again = next(stream)  # no change: sent again after the refresh interval
    assert [d.health for d in again.devices] == [1]
    from vgpu_plugin.kubelet.dra import health

    assert health.REFRESH_S * 3 <= health.TIMEOUT_S  # two refreshes may be late, not three


def test_a_client_that_goes_away_frees_its_stream() -> None:
    streams = HealthStreams(lambda: [], refresh_s=3600)
    context = _Context()
    stream = streams.watch(context)
    next(stream)
    assert streams.open_streams == 1
    done = threading.Event()

    def read_on() -> None:
        for _ in stream:
            pass
        done.set()

    reader = threading.Thread(target=read_on)
    reader.start()
    for callback in context.callbacks:  # gRPC calls these when the client cancels
        callback()
    reader.join(timeout=30)
    assert done.is_set() and streams.open_streams == 0


def test_a_newer_stream_ends_and_cancels_the_oldest_beyond_the_bound() -> None:
    streams = HealthStreams(lambda: [], refresh_s=3600, max_streams=2)
    contexts = [_Context() for _ in range(3)]
    opened = [streams.watch(c) for c in contexts]
    for s in opened[:2]:
        next(s)
    assert streams.open_streams == 2
    next(opened[2])  # the third: the first one ends
    assert contexts[0].cancelled and not contexts[1].cancelled and not contexts[2].cancelled
    assert list(opened[0]) == []  # its generator returns
    assert streams.open_streams == 2
    streams.stop()  # stop ends the others cleanly: no cancel
    assert list(opened[1]) == [] and list(opened[2]) == []
    assert not contexts[1].cancelled and streams.open_streams == 0
