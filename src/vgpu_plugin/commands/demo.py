"""``vgpu-plugin demo``: a whole GPU node, simulated, showing each limit at work.

The scenario lives with the simulation (sim/demo.py), which the DaemonSet image does not ship;
this command only picks how containers run here and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from vgpu_plugin.node.host import native

NO_TORCH = 3  # --inference where PyTorch is not installed

HOW = {
    "runc": "containers under runc",
    "namespace": "containers as processes in private mount and pid namespaces (no runc here)",
    "preload": "containers as plain processes with the shim in LD_PRELOAD",
}


def positive_seconds(text: str) -> float:
    """``--seconds``: a finite number above 0 (argparse turns the error into a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: the workloads need a time above 0 s")
    return value


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seconds",
        type=positive_seconds,
        default=4.0,
        help="how long each workload runs, above 0 (default: %(default)s)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, state)")
    p.add_argument(
        "--inference",
        action="store_true",
        help="instead: 4 PyTorch inference pods on one 16 GiB GPU, each sizing its KV cache "
        f"to its slice (needs the torch extra; exit {NO_TORCH} without it)",
    )
    p.add_argument(
        "--compute",
        action="store_true",
        help="instead: compute guarantees (sharing.compute: guaranteed) on one GPU: a pod keeps"
        " its share next to a noisier one, and its idle time is lent to it",
    )
    p.add_argument(
        "--runtime",
        default="auto",
        choices=["auto", *HOW],
        help="how containers run: runc where it can, else namespaces as root, else LD_PRELOAD "
        "(default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        print(text, flush=True)

    if args.inference and importlib.util.find_spec("torch") is None:
        print("vgpu-plugin demo --inference: PyTorch is not installed here; install the torch "
              "extra: pip install '.[torch]'", file=sys.stderr)  # fmt: skip
        return NO_TORCH
    try:
        from vgpu_plugin.sim import demo, inference_demo
        from vgpu_plugin.sim.process import choose_runtime
    except ImportError as exc:
        print(f"vgpu-plugin demo: the simulator is not part of this install ({exc}); the "
              "DaemonSet image ships without it. Install from the source tree: pip install .",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        runtime, why = choose_runtime(args.runtime)
        native.shim_library()
        native.simgpu_dir()
    except (ValueError, native.NativeArtifactMissing) as exc:
        print(f"vgpu-plugin demo: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vgpu-demo-"))
    say(f"vgpu-plugin demo: one simulated GPU node, the real plugin, {HOW[runtime]}")
    if runtime != "runc":
        say(f"      ({why})")
    if args.inference:
        return finish(args, work, say, lambda: inference_demo.run_inference_demo(
            work, args.seconds, say, runtime))  # fmt: skip
    if args.compute:
        from vgpu_plugin.sim import compute_demo

        return finish(args, work, say, lambda: compute_demo.run_compute_demo(
            work, args.seconds, say, runtime).held)  # fmt: skip
    if any(p.name == "cupy" for p in demo.default_pods(args.seconds)):
        say("      (CuPy is installed here: a 'cupy' pod allocates through NVIDIA's CUDA "
            "runtime too)")  # fmt: skip

    def plain() -> bool:
        return all(p.held for p in demo.run_demo(work, args.seconds, say, runtime))

    return finish(args, work, say, plain)


def finish(
    args: argparse.Namespace, work: Path, say: Callable[[str], None], scenario: Callable[[], bool]
) -> int:
    """Run the scenario: exit 0 when everything held, 1 when not or on a failure."""
    try:
        rc = 0 if scenario() else 1
    except Exception as exc:
        print(f"vgpu-plugin demo failed: {exc} (logs in {work})", file=sys.stderr)
        args.keep = True
        rc = 1
    if args.keep:
        say(f"work dir kept: {work} (plugin.log has the plugin's log)")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return rc
