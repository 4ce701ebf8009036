"""What a compute guarantee costs a launch when the GPU is not contended (docs/compute.md).

    python bench/bench_guarantee.py

Prints the instructions callgrind counts per cuLaunchKernel (a zero-length kernel, so the
budget is never in debt: the uncontended path) under the shim for
- a cap of 50 % (`CUDA_DEVICE_SM_LIMIT=50`: today's paced path, timing events included);
- a guarantee of 25 % with no cap (`CUDA_DEVICE_SM_REQUEST=25`), no peers;
- the same guarantee beside three idle peers' pacing files;
each as ((3n launches) - (n launches)) / 2n, start-up cancelled, and the guarantee's figures
as added over the cap's (target <= +30). Under valgrind the program runs about 50 times
slower, so the work done per 2 ms (the rate) and per 40 ms (the peers' files looked for) falls
on fewer launches than natively: the figures are upper bounds. Programs: tests/native/shim_bench.c
(bench_shim.py's). It asserts nothing: it prints figures.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shim import Bench, _tree


def per_launch(b: Bench, env: dict[str, str], n: int) -> float:
    one = b.instructions(env, "launch", n)
    three = b.instructions(env, "launch", 3 * n)
    return (three - one) / (2 * n)


def main() -> int:
    if not shutil.which("valgrind"):
        print("not measured: valgrind is not installed")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(_tree(), Path(tmp))
        b.settle()
        peers = Path(tmp) / "peers"
        peers.mkdir()
        cap = dict(b.shim, CUDA_DEVICE_SM_LIMIT="50")
        alone = dict(
            b.shim,
            CUDA_DEVICE_SM_LIMIT="100",
            CUDA_DEVICE_SM_REQUEST="25",
            VGPU_COMPUTE_PEERS=str(peers),
        )
        n = 2000
        capped = per_launch(b, cap, n)
        print(f"cap 50 %: {capped:.0f} instructions/launch (today's paced path)")
        g = per_launch(b, alone, n)
        print(f"guarantee 25 %, no peers: {g:.0f} instructions/launch, added {g - capped:+.0f}")
        # Three idle peers: their pacing files made by a short run of each (then idle).
        for name in ("p1", "p2", "p3"):
            env = dict(
                alone,
                CUDA_DEVICE_MEMORY_SHARED_CACHE=str(peers / name / "r.cache"),
            )
            (peers / name).mkdir()
            b.run(env, "launch", 10)
        g3 = per_launch(b, alone, n)
        print(
            f"guarantee 25 %, three idle peers: {g3:.0f} instructions/launch, "
            f"added {g3 - capped:+.0f} (target <= +30)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
