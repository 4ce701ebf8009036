"""Helpers shared by the shim's tests (test_shim_*.py); this module holds no tests itself.

The shim (``<build>/lib/libvgpu.so``) is loaded with ``LD_PRELOAD`` into the C programs of
tests/native/shim_*.c, which run on a simulated node (native/simgpu). Each test gets its own
region file, lock dir and limits-file path under its tmp dir, so tests never share state.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conftest import say_to_each

from vgpu_plugin.sim.simgpu import Node

MIB = 1 << 20
GIB = 1 << 30
CONTEXT = 300 * MIB  # the simulated GPUs' context overhead (conftest's default)
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY

# What the outer environment must not leak into a test's processes.
_SHIM_VARS = ("CUDA_", "NVIDIA_VISIBLE_DEVICES", "VGPU_", "LIBVGPU_", "LD_PRELOAD")


@dataclass
class Result:
    rc: int
    out: dict[str, str]
    stdout: str
    stderr: str

    def int(self, key: str) -> int:
        return int(self.out[key])

    def float(self, key: str) -> float:
        return float(self.out[key])


def parse(stdout: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


@functools.cache
def asan_runtime() -> str:
    """The compiler's AddressSanitizer runtime, which must come first in a process."""
    cc = os.environ.get("CC", "cc")
    out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True)
    return out.stdout.strip()


@dataclass
class Shim:
    """One test's view of the shim: its build tree, node and private paths."""

    tree: Path
    node: Node
    tmp: Path
    preload: list[Path] = field(default_factory=list)

    @property
    def lib(self) -> Path:
        return self.tree / "lib" / "libvgpu.so"

    @property
    def region(self) -> Path:
        return self.tmp / "vgpu" / "r.cache"

    @property
    def limits_path(self) -> Path:
        return self.tmp / "limits"

    def prog(self, name: str) -> Path:
        return self.tree / "tests" / name

    def env(self, limits: Mapping[str, str] | None = None, shim: bool = True) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(_SHIM_VARS)}
        env = self.node.env(base)
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(self.region)
        env["VGPU_LOCK_DIR"] = str(self.tmp / "lock")
        env["VGPU_LIMITS_FILE"] = str(self.limits_path)
        if shim:
            env["LD_PRELOAD"] = self.preload_list([*self.preload, self.lib])
        env.update(limits or {})
        return env

    def preload_list(self, libs: Sequence[Path]) -> str:
        """LD_PRELOAD for `libs`; the sanitizer build's runtime must come first."""
        first = [Path(asan_runtime())] if self.tree.name == "native-asan" else []
        return ":".join(str(p) for p in [*first, *libs])

    def write_limits(
        self,
        gpus: Sequence[tuple[str, int, int]],
        allocation: str = "alloc-1",
        oversubscribe: bool = False,
        text: str | None = None,
    ) -> Path:
        """The limits file as the plugin writes it (docs/limits-file.md), or raw `text`."""
        if text is None:
            lines = ["vgpu-limits 1", f"allocation {allocation}"]
            lines.append(f"oversubscribe {1 if oversubscribe else 0}")
            lines += [f"gpu {uuid} {mem} {sm}" for uuid, mem, sm in gpus]
            text = "\n".join(lines) + "\n"
        self.limits_path.write_text(text)
        self.limits_path.chmod(0o444)
        return self.limits_path

    def run(
        self,
        prog: str,
        *args: str | int,
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
        stdin: str | None = None,
    ) -> Result:
        proc = subprocess.run(
            [str(self.prog(prog)), *map(str, args)],
            env=dict(env if env is not None else self.env()),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return Result(proc.returncode, parse(proc.stdout), proc.stdout, proc.stderr)

    def start(
        self, prog: str, *args: str | int, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(self.prog(prog)), *map(str, args)],
            env=dict(env if env is not None else self.env()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def read_until(proc: subprocess.Popen[str], marker: str) -> dict[str, str]:
    """Lines of a started program up to `marker`, as key=value pairs (the program then waits
    for its stdin to close; pytest's timeout covers one that never gets there)."""
    assert proc.stdout is not None
    text = ""
    while True:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"pid {proc.pid} ended before {marker!r}: {text!r} {err!r}")
        if line.strip() == marker:
            return parse(text)
        text += line


def start_together(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Wait until every started program has printed "ready", then let them all go at once
    (each waits for a line on its stdin)."""
    for p in procs:
        read_until(p, "ready")
    say_to_each(procs, "")


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> Result:
    """Close a started program's stdin and collect the rest of its output."""
    out, err = proc.communicate("", timeout=timeout)
    return Result(proc.returncode, parse(out), out, err)
