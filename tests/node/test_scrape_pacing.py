"""Scrapes are paced: one at a time, each after a rest of ``ratio`` times the CPU the last one
cost, so scrapers back to back cannot take the CPU that Allocate needs."""

from __future__ import annotations

import socket
import threading
import urllib.request
from pathlib import Path

from prometheus_client import Gauge

from vgpu_plugin.node.observe import metrics
from vgpu_plugin.node.observe.metrics import ScrapePacer
from vgpu_plugin.node.observe.nodeview import view_provider


class Fake:
    """A clock, a thread CPU clock and a sleep that only record."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


def test_the_next_scrape_rests_ratio_times_the_cpu_the_last_one_cost() -> None:
    f = Fake()
    pacer = ScrapePacer(10, max_wait=2.0, clock=lambda: f.now, cpu=lambda: f.cpu, sleep=f.sleep)
    token = pacer.begin()
    assert f.slept == []  # the first scrape goes at once
    f.cpu += 0.004  # it cost 4 ms of CPU...
    f.now += 0.030  # ...over 30 ms (writing to a slow client costs no CPU)
    pacer.end(token)
    f.now += 0.010
    pacer.end(pacer.begin())
    assert f.slept == [0.03]  # 40 ms after the first ended, less the 10 ms gone by
    token = pacer.begin()
    f.cpu += 1.0  # a scrape that cost a second of CPU: the next waits at most max_wait
    pacer.end(token)
    pacer.begin()
    assert f.slept == [0.03, 2.0]


def test_one_scrape_at_a_time() -> None:
    pacer = ScrapePacer(0.0001)
    first = pacer.begin()
    order: list[str] = []

    def second() -> None:
        pacer.end(pacer.begin())
        order.append("second served")

    t = threading.Thread(target=second)
    t.start()
    t.join(0.2)  # not a timing: the second scrape cannot get its turn while the first runs
    assert t.is_alive() and order == []
    order.append("first ended")
    pacer.end(first)
    t.join(30)
    assert order == ["first ended", "second served"]


def test_a_client_that_hangs_up_mid_body_ends_its_turn(tmp_path: Path) -> None:
    # Had the first scrape's turn not ended, the pacer's lock would stay held: the next
    # scrapes would hang until their timeout.
    pm = metrics.new_registry(view_provider(tmp_path / "host", lambda: [], lambda: []))
    server, port = metrics.serve_metrics("127.0.0.1:0", pm.registry, pace=1e-9)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert s.recv(12).startswith(b"HTTP/1.0 200")
        for headers in ({}, {"Accept-Encoding": "gzip"}):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
            with urllib.request.urlopen(request, timeout=10) as r:
                assert r.status == 200 and r.read()
    finally:
        server.shutdown()


def test_a_client_that_stops_reading_delays_the_others_by_max_wait_at_most(
    tmp_path: Path,
) -> None:
    # A scrape's turn lasts until its body is sent; a client that asks and never reads would
    # hold it for good and wedge every later scrape (Prometheus's included) without the bound.
    pm = metrics.new_registry(view_provider(tmp_path / "host", lambda: [], lambda: []))
    big = Gauge(
        "test_big", "a body far larger than the sockets' buffers", ["n"], registry=pm.registry
    )
    for n in range(100_000):
        big.labels(f"{n:040d}").set(n)
    server, port = metrics.serve_metrics("127.0.0.1:0", pm.registry, pace=1e-9)
    stalled = socket.socket()
    try:
        # A receive buffer of a few KiB and a body of ~8 MiB: the server's write blocks.
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert stalled.recv(12).startswith(b"HTTP/1.0 200")
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 200 and r.read()
    finally:
        stalled.close()
        server.shutdown()


def test_a_turn_not_given_within_max_wait_serves_the_scrape_unpaced() -> None:
    pacer = ScrapePacer(10, max_wait=0.05)
    held = pacer.begin()
    assert held is not None
    assert pacer.begin() is None and pacer.unpaced == 1
    pacer.end(None)  # an unpaced scrape's end gives back nothing
    pacer.end(held)
    assert pacer.begin() is not None
