"""What the shim costs (docs/contracts.md#performance-targets), against the programs without it.

    python bench/bench_shim.py [--repeat 5]

Prints, in one run (with and without the shim interleaved; the best of --repeat runs, since a
shared machine only ever adds time, except where a median is named):
- instructions added per cuLaunchKernel (target <= 20), per cuMemAlloc + cuMemFree pair
  (target <= 300), per cuCtxCreate + cuCtxDestroy pair (target <= 2,000, also after 20,000
  allocations made and freed) and per cuMemGetInfo (target <= 200), counted by callgrind
  (valgrind) and so repeatable on a loaded machine: the program runs n and 3n calls with and
  without the shim, and the added count per call is ((shim 3n - shim n) - (plain 3n - plain n))
  / 2n, start-up cost cancelled. One unmeasured run under the shim comes first, so that the
  container's region already exists in every measured run (equal starting states); and the
  instructions of /bin/true with the shim, with an empty library and with nothing preloaded.
  ``--instructions`` prints these figures only;
- ns added per cuLaunchKernel with no compute limit (target <= 20) and per cuMemAlloc +
  cuMemFree pair under a memory limit (target <= 150): measured in one process under the
  shim, alternating blocks of calls through the hook and straight to the driver's own entry
  point (same process, same memory layout: a difference of a few ns is not lost in noise);
- 8 processes of one container allocating at once vs one process: CPU ns per pair and the
  ratio (target <= 2x), beside the same ratio without the shim (what the simulator itself costs);
- /bin/true with the shim preloaded vs without (target <= 3 %), beside an empty preloaded
  library (what any preload costs), by LD_PRELOAD and, where root may make a mount namespace,
  by /etc/ld.so.preload as pods get it (the loader then also reads that file; median of
  1000 x --repeat spawns per variant, variants taking turns: tests/native/spawn_bench.c);
- added latency of the first CUDA calls (cuInit .. first allocation; target <= 5 ms), and the
  p99 of 64 processes starting at once (target <= 50 ms added); and the same first calls for
  the first process of a container (a fresh region: it creates the region and asks NVML
  whether the driver holds the container to a memory limit, which later processes skip).
  ``--first-calls`` prints these figures only.
Programs: tests/native/shim_bench.c, built with the tests (``VGPU_NATIVE_DIR`` if it has them,
else tests/native_build.py's release build). It asserts nothing: it prints figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _tree() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import native_build

    return native_build.tree_with("shim_bench")


class Bench:
    def __init__(self, tree: Path, tmp: Path) -> None:
        from vgpu_plugin.sim.simgpu import GpuSpec, Node

        os.environ["VGPU_NATIVE_DIR"] = str(tree)
        self.tree = tree
        self.tmp = tmp
        self.node = Node.create(tmp / "node", [GpuSpec(memory=80 << 30)], seed="bench")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_PRELOAD"))}
        lib = str(tree / "lib" / "libvgpu.so")
        self.shim = dict(
            self.node.env(base),
            LD_PRELOAD=lib,
            CUDA_DEVICE_MEMORY_LIMIT="64g",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp / "vgpu" / "bench.cache"),
            VGPU_LOCK_DIR=str(tmp / "lock"),
            VGPU_LIMITS_FILE=str(tmp / "no-limits-file"),
        )
        # The same environment, byte for byte as long, without the preload (the dynamic loader
        # skips blanks): a different environment size moves the stack and changes timings.
        self.plain = dict(self.shim, LD_PRELOAD=" " * len(lib))
        self.cg_runs: list[Path] = []

    def run(self, env: Mapping[str, str], *args: str | int) -> dict[str, float]:
        prog = str(self.tree / "tests" / "shim_bench")
        out = subprocess.run(
            [prog, *map(str, args)], env=dict(env), capture_output=True, text=True, check=True
        ).stdout
        return {k: float(v) for k, _, v in (ln.partition("=") for ln in out.split())}

    def paired(self, key: str, repeat: int, *args: str | int) -> tuple[float, float]:
        plain, shim = [], []
        for _ in range(repeat):
            plain.append(self.run(self.plain, *args)[key])
            shim.append(self.run(self.shim, *args)[key])
        return min(plain), min(shim)

    def settle(self) -> None:
        """One unmeasured run under the shim: the container's region exists (and the driver's
        limit was asked) before any measured run, so every measured run starts from the same
        state. Without it the first measured run alone pays the region's creation (~14,000
        instructions), which made the shorter run dearer and the per-call figure too low."""
        self.run(self.shim, "alloc", 10)

    def callgrind(self, env: Mapping[str, str], cmd: list[str], name: str) -> int:
        """Instructions `cmd` executes in all (callgrind)."""
        out = self.tmp / f"callgrind.{name}.{len(self.cg_runs)}"
        self.cg_runs.append(out)
        vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd]
        subprocess.run(vg, env=dict(env), capture_output=True, check=True)
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no instruction total in {out}")

    def instructions(self, env: Mapping[str, str], what: str, n: int, *extra: str) -> int:
        """Instructions the whole program `shim_bench <what> <n> [extra]` executes."""
        prog = str(self.tree / "tests" / "shim_bench")
        return self.callgrind(env, [prog, what, str(n), *extra], f"{what}.{n}")

    def added_instructions(self, what: str, n: int, *extra: str) -> tuple[float, float]:
        """(instructions per call without the shim, instructions the shim adds per call)."""
        s1 = self.instructions(self.shim, what, n, *extra)
        s3 = self.instructions(self.shim, what, 3 * n, *extra)
        p1 = self.instructions(self.plain, what, n, *extra)
        p3 = self.instructions(self.plain, what, 3 * n, *extra)
        per_plain = (p3 - p1) / (2 * n)
        return per_plain, (s3 - s1) / (2 * n) - per_plain

    def true_instructions(self, preload: str) -> int:
        """Instructions of /bin/true with `preload` (padded to the shim's path length, so
        every variant has the same environment size; blanks: nothing preloaded)."""
        pad = len(self.shim["LD_PRELOAD"])
        env = dict(self.plain, LD_PRELOAD=preload.ljust(pad))
        return self.callgrind(env, ["/bin/true"], "true")

    def concurrent_alloc(self, env: Mapping[str, str], procs: int, n: int) -> float:
        prog = str(self.tree / "tests" / "shim_bench")
        ps = [
            subprocess.Popen(
                [prog, "alloc", str(n), str(1 << 20), "gate"],
                env=dict(env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(procs)
        ]
        for p in ps:
            assert p.stdout is not None
            while p.stdout.readline().strip() != "ready":
                pass
        for p in ps:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        cpu = []
        for p in ps:
            out, _ = p.communicate()
            cpu.append(float(dict(ln.split("=") for ln in out.split())["cpu_ns_per_pair"]))
        return statistics.median(cpu)

    def spawn_medians(
        self, rounds: int, variants: list[str], etc_overlay: bool = False
    ) -> dict[str, float]:
        """Median us of /bin/true per variant (tests/native/spawn_bench.c); with etc_overlay,
        in a mount namespace whose /etc is a writable overlay ({} where that is impossible)."""
        cmd = [str(self.tree / "tests" / "spawn_bench"), str(rounds), "/bin/true", *variants]
        if etc_overlay:
            if os.geteuid() != 0:
                return {}
            up, work = self.tmp / "etc-upper", self.tmp / "etc-work"
            up.mkdir(exist_ok=True)
            work.mkdir(exist_ok=True)
            mount = f"mount -t overlay overlay -o lowerdir=/etc,upperdir={up},workdir={work} /etc"
            cmd = ["unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh", *cmd]
        r = subprocess.run(cmd, env=self.plain, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            if etc_overlay:
                return {}
            raise RuntimeError(f"spawn_bench failed: {r.stderr.strip()}")
        return {v: float(us) for v, _, us in (ln.rpartition(" ") for ln in r.stdout.splitlines())}

    def init_fresh_region(self, repeat: int) -> float:
        """Best first-calls time of a container's first process: a region no process made."""
        runs = []
        for i in range(repeat):
            region = self.tmp / "vgpu" / f"fresh-{i}.cache"
            runs.append(self.run(dict(self.shim, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region)),
                                 "init")["init_us"])  # fmt: skip
        return min(runs)

    def init_many(self, env: Mapping[str, str], procs: int) -> list[float]:
        prog = str(self.tree / "tests" / "shim_bench")
        ps = [
            subprocess.Popen([prog, "init"], env=dict(env), stdout=subprocess.PIPE, text=True)
            for _ in range(procs)
        ]
        return [float(p.communicate()[0].split("=")[1]) for p in ps]


def first_calls(b: Bench, repeat: int) -> None:
    plain, shim = b.paired("init_us", max(repeat, 9), "init")
    print(
        f"first CUDA calls (cuInit .. first cuMemAlloc): {plain / 1e3:.2f} -> "
        f"{shim / 1e3:.2f} ms, added {(shim - plain) / 1e3:+.2f} ms (target <= 5 ms)"
    )
    fresh = b.init_fresh_region(max(repeat, 9))
    print(
        f"first CUDA calls of a container's first process (fresh region, driver limit asked): "
        f"{plain / 1e3:.2f} -> {fresh / 1e3:.2f} ms, added {(fresh - plain) / 1e3:+.2f} ms "
        f"(target <= 5 ms)"
    )


def empty_library(tmp: Path, path_len: int = 0) -> Path | None:
    """An empty shared library built the default way: what any preload costs. Named, where
    `path_len` is long enough, with a path as long as the shim's: the loader's work on a
    preload's path grows with its length, and padding a shorter one with blanks costs more
    (each blank is a separator the loader skips: about 58 instructions)."""
    name = "libempty.so"
    room = path_len - len(str(tmp / name))
    if room > 0:
        name = f"libempty{'_' * room}.so"
    empty = tmp / name
    if not empty.exists():
        (tmp / "empty.c").write_text("int vgpu_bench_empty(void) { return 0; }\n")
        cc = ["cc", "-O2", "-shared", "-fPIC", "-o", str(empty), str(tmp / "empty.c")]
        if subprocess.run(cc, capture_output=True, check=False).returncode != 0:
            return None
    return empty


def instruction_counts(b: Bench, tmp: Path) -> None:
    """Every callgrind figure, each from equal starting states (Bench.settle)."""
    b.settle()
    base, added = b.added_instructions("launch", 1000)
    print(
        f"cuLaunchKernel, no compute limit: {base:.0f} instructions/call, "
        f"added {added:+.0f} (callgrind; target <= 20)"
    )
    base, added = b.added_instructions("alloc", 1000)
    print(
        f"cuMemAlloc+cuMemFree under a limit: {base:.0f} instructions/pair, "
        f"added {added:+.0f} (callgrind; target <= 300)"
    )
    base, added = b.added_instructions("ctx", 100)
    print(
        f"cuCtxCreate+cuCtxDestroy under a limit: {base:.0f} instructions/pair, "
        f"added {added:+.0f} (callgrind; target <= 2,000)"
    )
    base, added = b.added_instructions("ctx", 100, "history")
    print(
        f"the same after 20,000 allocations made and freed: {base:.0f} instructions/pair, "
        f"added {added:+.0f} (callgrind; target <= 2,000, flat)"
    )
    base, added = b.added_instructions("meminfo", 1000)
    print(
        f"cuMemGetInfo under a limit: {base:.0f} instructions/call, "
        f"added {added:+.0f} (callgrind; target <= 200)"
    )
    none = b.true_instructions("")
    shim = b.true_instructions(b.shim["LD_PRELOAD"])
    empty = empty_library(tmp, len(b.shim["LD_PRELOAD"]))
    line = f"/bin/true: {none} instructions, with the shim preloaded {shim - none:+d}"
    if empty is not None:
        line += f"; an empty library {b.true_instructions(str(empty)) - none:+d}"
    print(line + " (callgrind; target: the shim <= an empty library)")


def _preload_line(how: str, t: dict[str, float], shim: str, empty: str, note: str) -> str:
    base, with_shim = t["none"], t[shim]
    line = (
        f"/bin/true via {how}: {base:.0f} -> {with_shim:.0f} us with the shim "
        f"({(with_shim / base - 1) * 100:+.1f} %, {note})"
    )
    if empty in t:
        line += f"; an empty library: {t[empty]:.0f} us ({(t[empty] / base - 1) * 100:+.1f} %)"
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--first-calls", action="store_true", help="the first-calls figures only")
    ap.add_argument(
        "--instructions", action="store_true", help="the callgrind instruction counts only"
    )
    args = ap.parse_args(argv)
    tree = _tree()
    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(tree, Path(tmp))
        print(f"shim bench on simgpu, {os.cpu_count()} CPUs, best of {args.repeat} runs")
        if args.first_calls:
            first_calls(b, args.repeat)
            return 0

        if shutil.which("valgrind"):
            instruction_counts(b, Path(tmp))
        else:
            print("instruction counts: not measured (valgrind is not installed)")
        if args.instructions:
            return 0

        ab = [b.run(b.shim, "ab-launch", 400000) for _ in range(args.repeat)]
        real, hook = min(r["real_ns"] for r in ab), min(r["hook_ns"] for r in ab)
        print(
            f"cuLaunchKernel, no compute limit: {real:.1f} -> {hook:.1f} ns/call, "
            f"added {hook - real:+.1f} ns (target <= 20)"
        )

        ab = [b.run(b.shim, "ab-alloc", 100000) for _ in range(args.repeat)]
        real, hook = min(r["real_ns"] for r in ab), min(r["hook_ns"] for r in ab)
        print(
            f"cuMemAlloc+cuMemFree under a limit: {real:.0f} -> {hook:.0f} ns/pair, "
            f"added {hook - real:+.0f} ns (target <= 150)"
        )

        n = 20000
        one = [b.concurrent_alloc(b.shim, 1, n) for _ in range(args.repeat)]
        eight = [b.concurrent_alloc(b.shim, 8, n) for _ in range(args.repeat)]
        p1 = [b.concurrent_alloc(b.plain, 1, n) for _ in range(args.repeat)]
        p8 = [b.concurrent_alloc(b.plain, 8, n) for _ in range(args.repeat)]
        s1, s8, q1, q8 = min(one), min(eight), min(p1), min(p8)
        print(
            f"8 processes allocating at once vs 1, CPU ns/pair: with shim {s1:.0f} -> {s8:.0f} "
            f"({s8 / s1:.2f}x, target <= 2x); without {q1:.0f} -> {q8:.0f} ({q8 / q1:.2f}x)"
        )

        lib = b.shim["LD_PRELOAD"]
        empty = empty_library(Path(tmp), len(lib))
        have_empty = empty is not None
        rounds = 1000 * args.repeat
        variants = ["none", f"env:{lib}"] + ([f"env:{empty}"] if have_empty else [])
        t = b.spawn_medians(rounds, variants)
        print(_preload_line("LD_PRELOAD", t, variants[1], f"env:{empty}", "target <= 3 %"))
        file_variants = ["none", f"file:{lib}"] + ([f"file:{empty}"] if have_empty else [])
        tf = b.spawn_medians(rounds, file_variants, etc_overlay=True)
        if tf:
            print(
                _preload_line(
                    "/etc/ld.so.preload", tf, file_variants[1], f"file:{empty}", "how pods get it"
                )
            )
        else:
            print(
                "/bin/true via /etc/ld.so.preload: not measured (needs root and mount namespaces)"
            )

        first_calls(b, args.repeat)

        many_plain = sorted(b.init_many(b.plain, 64))
        many_shim = sorted(b.init_many(b.shim, 64))
        p99p = many_plain[int(0.99 * 63)] / 1e3
        p99s = many_shim[int(0.99 * 63)] / 1e3
        print(
            f"64 processes starting at once, p99 of the first CUDA calls: {p99p:.2f} -> "
            f"{p99s:.2f} ms, added {p99s - p99p:+.2f} ms (target <= 50 ms)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
