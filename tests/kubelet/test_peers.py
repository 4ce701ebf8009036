"""The device plugin keeps serving whatever the peers on its socket do (issue 26): streams
never take the threads Allocate needs, a flood of streams is bounded and refused in a
rate-limited line, and grpcio's tracebacks for malformed requests become one counted line."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kubelet.test_server_lifecycle import RESOURCE, FakeBackend, make_devices
from prometheus_client import generate_latest

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.kubelet import peers, servicer
from vgpu_plugin.kubelet.peers import PeerErrors, StreamSlots
from vgpu_plugin.kubelet.server import DevicePluginServer
from vgpu_plugin.node.observe.metrics import new_registry
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, short_tmp_dir

# The kubelet gives a device plugin call no deadline of its own; this is far beyond what an
# answered Allocate takes even on a loaded machine, and far below "never".
ALLOCATE_DEADLINE_S = 10.0
# How long the refusals may take to arrive on a loaded machine; not a timed assertion.
SETTLE_S = 120.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def errors(monkeypatch: pytest.MonkeyPatch) -> tuple[PeerErrors, FakeClock]:
    """A fresh PeerErrors, with a clock of the test's, where the servers and grpcio's
    loggers use it."""
    clock = FakeClock()
    fresh = PeerErrors(burst=5, window=60.0, clock=clock)
    monkeypatch.setattr(peers, "PEER_ERRORS", fresh)
    return fresh, clock


@pytest.fixture
def plugin(
    errors: tuple[PeerErrors, FakeClock],
) -> Iterator[tuple[KubeletEmulator, DevicePluginServer]]:
    root = short_tmp_dir()
    with KubeletEmulator(root) as kubelet:
        server = DevicePluginServer(FakeBackend(make_devices(4)), RESOURCE, root, poll_interval=0.1)
        server.start()
        try:
            kubelet.wait_devices(RESOURCE, lambda d: len(d) == 4, timeout=10)
            yield kubelet, server
        finally:
            server.stop(grace=0.2)


def channel_to(server: DevicePluginServer) -> grpc.Channel:
    assert server.socket_path is not None
    return grpc.insecure_channel(f"unix://{server.socket_path}")


def allocate(server: DevicePluginServer) -> pb.AllocateResponse:
    with channel_to(server) as channel:
        stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        request = pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[f"{make_devices(1)[0].ID}"])
            ]
        )
        return stub.Allocate(request, timeout=ALLOCATE_DEADLINE_S)  # type: ignore[no-any-return]


class Streams:
    """``n`` ListAndWatch calls over ``channels`` connections, left open; counts how many
    ended and with which code (the rest are open, the device list received)."""

    def __init__(self, server: DevicePluginServer, n: int, channels: int = 1) -> None:
        self._cond = threading.Condition()
        self.ended: dict[grpc.StatusCode, int] = {}
        self.by_plugin = 0  # refused by the plugin's stream limit, the others by gRPC's own
        # Each a connection of its own, as other processes' (channels to one target in one
        # process share one by default).
        self.channels = [
            grpc.insecure_channel(
                f"unix://{server.socket_path}", options=[("grpc.use_local_subchannel_pool", 1)]
            )
            for _ in range(channels)
        ]
        self.calls = []
        for k in range(n):
            stub = pb_grpc.DevicePluginStub(self.channels[k % channels])  # type: ignore[no-untyped-call]
            call = stub.ListAndWatch(pb.Empty())
            call.add_done_callback(self._done)
            self.calls.append(call)

    def _done(self, call: grpc.Call) -> None:
        with self._cond:
            code = call.code()
            self.ended[code] = self.ended.get(code, 0) + 1
            if (
                call.details()
                == f"{servicer.DEFAULT_MAX_STREAMS} ListAndWatch streams are open, the limit"
            ):
                self.by_plugin += 1
            self._cond.notify_all()

    def wait_ended(self, n: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: sum(self.ended.values()) >= n, timeout)
            return sum(self.ended.values())

    def refused(self, n: int) -> int:
        """Checks that exactly ``n`` ended, all refused, and returns how many the plugin
        refused; the others gRPC refused itself (RESOURCE_EXHAUSTED over the server's 128
        calls in flight; UNAVAILABLE over a connection's 64 streams, sent before the client
        heard of the limit; CANCELLED by a transport under load)."""
        with self._cond:
            ended, by_plugin = dict(self.ended), self.by_plugin
        assert sum(ended.values()) == n
        refusals = {
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
        }
        assert set(ended) <= refusals, ended
        assert by_plugin > 0
        return by_plugin

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            channel.close()


def test_allocate_answers_while_100_idle_streams_are_open(
    plugin: tuple[KubeletEmulator, DevicePluginServer],
    errors: tuple[PeerErrors, FakeClock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    kubelet, server = plugin
    caplog.set_level(logging.WARNING, logger=peers.__name__)
    streams = Streams(server, 100)
    try:
        limit = servicer.DEFAULT_MAX_STREAMS
        streams.wait_ended(100 - (limit - 1), SETTLE_S)  # the kubelet holds one
        # Before the fix each of these streams held one of the 16 threads for its life, and
        # this Allocate (like the kubelet's own) waited for a thread until its deadline.
        response = allocate(server)
        assert response.container_responses[0].envs["VGPU_DEVICES"] == make_devices(1)[0].ID
        refused = streams.refused(100 - (limit - 1))
        # The kubelet's stream is untouched: it still gets every change.
        server.backend.set_devices(make_devices(5))  # type: ignore[attr-defined]
        kubelet.wait_devices(RESOURCE, lambda d: len(d) == 5, timeout=10)
    finally:
        streams.close()
    lines = [r for r in caplog.records if getattr(r, "peer_error", "") == "streams_over_limit"]
    assert 1 <= len(lines) <= 5  # one line each, rate-limited: not 97
    assert "ListAndWatch refused: 4 streams are open on this socket" in lines[0].getMessage()
    assert errors[0].count("streams_over_limit") == refused


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_ten_thousand_streams_are_bounded_and_refused(
    plugin: tuple[KubeletEmulator, DevicePluginServer],
    errors: tuple[PeerErrors, FakeClock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, server = plugin
    caplog.set_level(logging.WARNING, logger=peers.__name__)
    fds, threads = open_fds(), threading.active_count()
    n, channels = 10_000, 20
    streams = Streams(server, n, channels)
    try:
        limit = servicer.DEFAULT_MAX_STREAMS
        assert streams.wait_ended(n - (limit - 1), SETTLE_S) == n - (limit - 1)
        refused = streams.refused(n - (limit - 1))
        # What the flood holds is bounded: the server's pool (16 threads, whatever came), a
        # thread per client channel here, and an fd or two per connection.
        pool = [t for t in threading.enumerate() if t.name.startswith("vgpu-grpc")]
        assert len(pool) <= 16
        assert threading.active_count() <= threads + 16 + channels
        assert open_fds() <= fds + 4 * channels + 8  # both ends are in this process
        assert allocate(server).container_responses
    finally:
        streams.close()
    lines = [r for r in caplog.records if getattr(r, "peer_error", "") == "streams_over_limit"]
    assert 1 <= len(lines) <= 5
    assert errors[0].count("streams_over_limit") == refused


def test_a_malformed_request_is_one_counted_line_not_a_traceback(
    plugin: tuple[KubeletEmulator, DevicePluginServer],
    errors: tuple[PeerErrors, FakeClock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, server = plugin
    peer_errors, clock = errors
    caplog.set_level(logging.DEBUG)
    with channel_to(server) as channel:
        raw = channel.unary_unary("/v1beta1.DevicePlugin/Allocate")
        for _ in range(20):
            with pytest.raises(grpc.RpcError):
                raw(b"\xff\xff\xff\xff", timeout=ALLOCATE_DEADLINE_S)
        clock.now += 61.0  # a window later: one more line, saying how many were left out
        with pytest.raises(grpc.RpcError):
            raw(b"\xff\xff\xff\xff", timeout=ALLOCATE_DEADLINE_S)
    assert allocate(server).container_responses  # still serving
    assert [r for r in caplog.records if r.name.startswith("grpc")] == []
    lines = [r for r in caplog.records if getattr(r, "peer_error", "") == "malformed_request"]
    assert len(lines) == 6  # 5 of the first 20, then the one a window later
    for r in lines:
        assert r.exc_info is None and "\n" not in r.getMessage()
    assert "gRPC peer error (malformed_request): Exception deserializing message: " in (
        lines[0].getMessage()
    )
    assert (
        "(15 more malformed_request errors in the last 60 s not logged)" in lines[-1].getMessage()
    )
    assert peer_errors.count("malformed_request") == 21


def test_the_rate_limit_and_the_count_are_per_kind() -> None:
    clock = FakeClock()
    seen: list[str] = []
    errors = PeerErrors(burst=2, window=10.0, clock=clock)
    errors.add_listener(seen.append)
    logger = logging.getLogger(peers.__name__)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for _ in range(4):
            errors.note("malformed_request", "bad\nrequest %d", 1)
        errors.note("handler_error", "x")
        errors.note("no-such-kind", "y")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "gRPC peer error (malformed_request): bad request 1",
        "gRPC peer error (malformed_request): bad request 1",
        "gRPC peer error (handler_error): x",
        "gRPC peer error (other): y",
    ]
    assert seen == ["malformed_request"] * 4 + ["handler_error", "other"]
    assert (errors.count("malformed_request"), errors.count("other")) == (4, 1)


def test_stream_slots_release_once_and_refuse_past_the_limit() -> None:
    slots = StreamSlots(2)
    first, second = slots.acquire(), slots.acquire()
    assert first is not None and second is not None and slots.acquire() is None
    first()
    first()  # a stream's end callback and its generator's finally both release
    assert slots.open == 1 and slots.acquire() is not None and slots.acquire() is None
    with pytest.raises(ValueError, match="at least 1"):
        StreamSlots(0)


def test_streams_may_not_take_every_thread(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fewer than max_workers"):
        DevicePluginServer(FakeBackend([]), RESOURCE, tmp_path, max_workers=8, max_streams=8)


def test_peer_errors_are_counted_in_the_metrics_by_kind() -> None:
    metrics = new_registry()
    errors = PeerErrors(clock=FakeClock())
    errors.add_listener(metrics.peer_error)
    for _ in range(3):
        errors.note(peers.MALFORMED_REQUEST, "bad")
    errors.note(peers.STREAMS_OVER_LIMIT, "too many")
    text = generate_latest(metrics.registry).decode()
    assert 'vgpu_grpc_peer_errors_total{kind="malformed_request"} 3.0' in text
    assert 'vgpu_grpc_peer_errors_total{kind="streams_over_limit"} 1.0' in text
    assert 'vgpu_grpc_peer_errors_total{kind="prepare_queue_full"} 0.0' in text  # from the start


def test_invalid_requests_are_rate_limited_lines_of_bounded_length(
    plugin: tuple[KubeletEmulator, DevicePluginServer],
    errors: tuple[PeerErrors, FakeClock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, server = plugin
    caplog.set_level(logging.DEBUG)
    unknown = [f"GPU-nope-{k:06d}" for k in range(20_000)]
    with channel_to(server) as channel:
        stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=unknown)]
        )
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as err:
                stub.Allocate(request, timeout=ALLOCATE_DEADLINE_S)
            # The reason reaches the caller, cut short: whole, it would pass a header's
            # 16 KiB and the caller would see RESOURCE_EXHAUSTED instead.
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown device IDs: GPU-nope-000000" in err.value.details()
            assert err.value.details().endswith(" characters)")
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 5  # before: one line per call, each naming all 20,000 IDs
    assert all(len(line) < 700 and "characters)" in line for line in lines)
    assert errors[0].count(peers.INVALID_REQUEST) == 20
