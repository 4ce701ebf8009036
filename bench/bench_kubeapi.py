"""The DRA driver's claim read, client side (node/serving/kubeapi.py): CPU and wall time per
``GET`` of a ResourceClaim through the real ``kubernetes`` client, against the fake API server
over HTTP (sim/dra_kubelet.py's FakeApiHttp, in this process: its share is printed apart).

A pod's environment holds variables for the Services of its namespace; ``--env-vars N`` adds N
such variables first, since the client's generated call path read the whole environment (the
proxy settings) on every request.

    PYTHONPATH=src python bench/bench_kubeapi.py [--reads 2000] [--env-vars 300]

It asserts nothing: it prints figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from vgpu_plugin.node.serving.kubeapi import KubeApi
from vgpu_plugin.sim.dra_kubelet import FakeApiHttp, FakeApiServer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--env-vars", type=int, default=0, help="Service variables to add first")
    args = ap.parse_args()
    for i in range(args.env_vars):
        os.environ[f"SVC_{i}_SERVICE_HOST"] = f"10.96.{i // 250}.{i % 250}"
    api = FakeApiServer()
    http = FakeApiHttp(api).start()
    try:
        with tempfile.TemporaryDirectory() as work:
            kube = KubeApi(kubeconfig=str(http.write_kubeconfig(Path(work) / "kubeconfig")))
            api.add_claim("bench", "c0", {"gpu": {"memory": "6Gi", "compute": "10"}})
            for _ in range(200):  # the connection made, the code paths warm
                kube.get_claim("bench", "c0")
            before = resource.getrusage(resource.RUSAGE_SELF)
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.reads):
                kube.get_claim("bench", "c0")
            cpu = time.thread_time() - cpu
            wall = time.perf_counter() - wall
            after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        http.stop()
    process = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    n = args.reads
    print(f"{n} claim reads, {len(os.environ)} environment variables")
    print(f"client CPU per read: {cpu / n * 1e6:.0f} us (the reading thread)")
    print(f"fake API server CPU per read: {(process - cpu) / n * 1e6:.0f} us (its threads)")
    print(f"wall per read: {wall / n * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
