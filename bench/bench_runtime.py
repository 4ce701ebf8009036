"""What the shim adds to calls made through NVIDIA's CUDA runtime, on simgpu.

    python bench/bench_runtime.py [--pairs 20000] [--launches 20000] [--repeat 3]

One run, with and without the shim (1 GPU, 64 GiB limit, no compute limit):
- a cudaMalloc(1 MiB) + cudaFree pair through libcudart 12 (ctypes): ns per pair, best of
  --repeat, and callgrind's instruction count per pair (the difference between runs of N and
  2N pairs, so start-up cancels out);
- a kernel launch as CuPy makes it (RawModule, cuLaunchKernel on the runtime's primary context)
  of simgpu's built-in 0 ns kernel: ns per launch, best of --repeat.
Needs the test extra's wheels (nvidia-cuda-runtime-cu12, cupy-cuda12x) and, for instruction
counts, valgrind. It asserts nothing: it prints figures.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def child(kind: str, n: int, module: str) -> None:
    """Runs in the measured process: prints ns per operation."""
    import ctypes
    import time

    if kind == "pair":
        import nvidia  # type: ignore[import-not-found]

        lib = next(p for b in nvidia.__path__ for p in glob.glob(f"{b}/*/lib/libcudart.so.12"))
        rt = ctypes.CDLL(lib)
        rt.cudaFree(None)
        p = ctypes.c_void_p()
        size = ctypes.c_size_t(1 << 20)
        malloc, free, ref = rt.cudaMalloc, rt.cudaFree, ctypes.byref(p)
        t = time.perf_counter_ns()
        for _ in range(n):
            malloc(ref, size)
            free(p)
        print((time.perf_counter_ns() - t) / n)
    else:
        import cupy as cp
        import numpy as np

        kernel = cp.RawModule(path=module).get_function("simgpu_sleep")
        zero = np.uint64(0)
        kernel((1,), (1,), (zero,))
        cp.cuda.runtime.deviceSynchronize()
        t = time.perf_counter_ns()
        for _ in range(n):
            kernel((1,), (1,), (zero,))
        cp.cuda.runtime.deviceSynchronize()
        print((time.perf_counter_ns() - t) / n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), a.child[2])
        return

    sys.path.insert(0, str(ROOT / "tests"))
    import native_build

    from vgpu_plugin.sim.simgpu import GpuSpec, Node

    tree = native_build.build("release")
    os.environ["VGPU_NATIVE_DIR"] = str(tree)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        node = Node.create(tmp / "node", [GpuSpec(memory=80 << 30)], seed="bench")
        module = tmp / "sleep.simgpu"
        module.write_text("simgpu-module 1\n")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_PRELOAD"))}
        bare = node.env(base)
        shim = dict(
            bare,
            LD_PRELOAD=str(tree / "lib" / "libvgpu.so"),
            CUDA_DEVICE_MEMORY_LIMIT="64g",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp / "vgpu" / "bench.cache"),
            VGPU_LOCK_DIR=str(tmp / "lock"),
            VGPU_LIMITS_FILE=str(tmp / "limits"),
        )

        def measure(env: dict[str, str], kind: str, n: int) -> float:
            me = [sys.executable, __file__, "--child", kind, str(n), str(module)]
            runs = [subprocess.run(me, env=env, capture_output=True, text=True, check=True)]
            runs += [
                subprocess.run(me, env=env, capture_output=True, text=True, check=True)
                for _ in range(a.repeat - 1)
            ]
            return min(float(r.stdout.split()[-1]) for r in runs)

        def instructions(env: dict[str, str], n: int) -> int:
            out = tmp / f"cg.{n}.{'shim' if 'LD_PRELOAD' in env else 'bare'}"
            vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
            cmd = [*vg, sys.executable, __file__, "--child", "pair", str(n), str(module)]
            subprocess.run(cmd, env=env, capture_output=True, check=True)
            for line in out.read_text().splitlines():
                if line.startswith("totals:"):
                    return int(line.split()[1])
            raise RuntimeError("no totals in callgrind output")

        rows = []
        for name, kind, n in (
            ("cudaMalloc + cudaFree pair", "pair", a.pairs),
            ("kernel launch (CuPy RawModule)", "launch", a.launches),
        ):
            off, on = measure(bare, kind, n), measure(shim, kind, n)
            rows.append((name, off, on))
        print("| figure | without shim | with shim | added | ratio |")
        print("|---|---|---|---|---|")
        for name, off, on in rows:
            print(f"| {name} (ns) | {off:.0f} | {on:.0f} | {on - off:+.0f} | {on / off:.2f}x |")
        if shutil.which("valgrind"):
            small = 500
            per = {}
            for label, env in (("bare", bare), ("shim", shim)):
                per[label] = (instructions(env, 2 * small) - instructions(env, small)) / small
            print(
                f"| cudaMalloc + cudaFree pair (instructions, callgrind) | {per['bare']:.0f} "
                f"| {per['shim']:.0f} | {per['shim'] - per['bare']:+.0f} "
                f"| {per['shim'] / per['bare']:.2f}x |"
            )


if __name__ == "__main__":
    main()
