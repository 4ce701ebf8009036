"""Allocate while peers hold streams (issue 26): the device plugin server in process, behind
the kubelet emulator, with a backend that answers from memory (what is measured is the
server, not the allocation). Prints Allocate p50/p99 over ``--calls`` calls, one caller as
the kubelet calls: quiet, then with ``--streams`` idle ListAndWatch streams asked for (the
plugin keeps 4 open, the kubelet's among them, and refuses the rest), then while a peer
opens ``--flood`` streams as fast as it can; and the threads and fds the flood left.

    python bench/bench_peers.py [--calls 2000] [--streams 100] [--flood 10000]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import grpc

from vgpu_plugin.api.constants import HEALTHY
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.kubelet.backend import default_options
from vgpu_plugin.kubelet.server import DevicePluginServer
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, short_tmp_dir

RES = "nvidia.com/gpu"
IDS = [f"GPU-bench-{k}" for k in range(32)]


class MemoryBackend:
    def options(self) -> pb.DevicePluginOptions:
        return default_options()

    def devices(self) -> list[pb.Device]:
        return [pb.Device(ID=i, health=HEALTHY) for i in IDS]

    def wait_for_change(self, timeout: float) -> bool:
        time.sleep(timeout)
        return False

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        out = pb.AllocateResponse()
        for c in request.container_requests:
            out.container_responses.add(envs={"IDS": ",".join(c.devices_ids)})
        return out

    def preferred_allocation(
        self, request: pb.PreferredAllocationRequest
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse()

    def pre_start_container(
        self, request: pb.PreStartContainerRequest
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def timed(n: int, call: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def report(name: str, xs: list[float]) -> None:
    print(f"{name:<44} p50 {pct(xs, 50) * 1e3:6.3f} ms  p99 {pct(xs, 99) * 1e3:6.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--flood", type=int, default=10_000)
    args = ap.parse_args()
    root = short_tmp_dir("bench-")
    with KubeletEmulator(root) as kubelet:
        server = DevicePluginServer(MemoryBackend(), RES, root)  # type: ignore[arg-type]
        server.start()
        kubelet.wait_devices(RES, lambda d: len(d) == len(IDS), timeout=10)
        channel = grpc.insecure_channel(f"unix://{server.socket_path}")
        stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=IDS[:2])]
        )

        def allocate() -> object:
            return stub.Allocate(request, timeout=10)

        timed(100, allocate)  # warm-up
        quiet = timed(args.calls, allocate)
        report("Allocate, quiet", quiet)

        # A connection of its own, as another process has (channels to one target in one
        # process share one by default).
        peer = grpc.insecure_channel(
            f"unix://{server.socket_path}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        peer_stub = pb_grpc.DevicePluginStub(peer)  # type: ignore[no-untyped-call]
        streams = [peer_stub.ListAndWatch(pb.Empty()) for _ in range(args.streams)]
        time.sleep(1.0)
        held = sum(1 for s in streams if s.running())
        loaded = timed(args.calls, allocate)
        report(f"Allocate, {args.streams} streams asked ({held} held)", loaded)
        print(f"  p99 ratio to quiet: {pct(loaded, 99) / pct(quiet, 99):.2f}x")

        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        stop = threading.Event()
        opened = [0]

        def flood() -> None:
            calls = []
            while not stop.is_set() and opened[0] < args.flood:
                calls.append(peer_stub.ListAndWatch(pb.Empty()))
                opened[0] += 1
            for c in calls:
                c.cancel()

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        during = timed(args.calls, allocate)
        stop.set()
        flooder.join()
        report(f"Allocate, while {opened[0]} streams are opened", during)
        print(
            f"  during/after the flood: threads {threads} -> {threading.active_count()},"
            f" fds {fds} -> {len(os.listdir('/proc/self/fd'))}"
        )
        for s in streams:
            s.cancel()
        peer.close()
        channel.close()
        server.stop(grace=0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
