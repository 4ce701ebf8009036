"""``vgpu-plugin demo``: the README's first command, on whatever this machine can run.

The same scenario and verdicts under runc, in private namespaces (root without runc) and with
plain LD_PRELOAD (no root): the limits must hold in each, and the demo must say which it used.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vgpu_plugin.core.allocation import Mount
from vgpu_plugin.sim import compute_demo, process
from vgpu_plugin.sim.process import choose_runtime, host_path, preload_env
from vgpu_plugin.sim.runc import ContainerConfig, runc_unavailable_reason

HOW = {"runc": "under runc", "namespace": "private mount and pid", "preload": "LD_PRELOAD"}
REASONS = {
    "runc": runc_unavailable_reason(),
    "namespace": process.namespace_unavailable_reason(),
    "preload": None,
}


@pytest.mark.slow
@pytest.mark.parametrize("runtime", list(HOW))
def test_demo_shows_every_limit_holding(runtime: str, native_tree: Path) -> None:
    if REASONS[runtime]:
        pytest.skip(f"{runtime}: {REASONS[runtime]}")
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "demo", "--seconds", "3", "--runtime", runtime],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert HOW[runtime] in out.splitlines()[0]  # it says how containers ran
    for step in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
        assert step in out
    assert "demo/greedy/main" in out and "demo/batch-50/main" in out  # the status table
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    assert "clean CUDA_ERROR_OUT_OF_MEMORY at its limit" in lines["greedy"]
    assert "cuMemGetInfo shows a 4096 MiB GPU" in lines["greedy"]
    assert "all it asked for, within its limit" in lines["steady"]
    assert "on target" in lines["batch-50"] and "on target" in lines["batch-25"]
    assert "80GB" not in out  # 16 GiB simulated GPUs do not claim an 80 GB model's name
    if importlib.util.find_spec("cupy") is not None:  # a real client's pod, held the same way
        assert "CuPy is installed here" in out  # said, not added silently
        assert "through CuPy" in lines["cupy"]
        assert "at its limit" in lines["cupy"] and "cuMemGetInfo shows a 4096 MiB" in lines["cupy"]


def test_auto_picks_runc_then_namespaces_then_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    have = {"runc": True, "unshare": True, "chroot": True}
    monkeypatch.setattr(
        process.shutil, "which", lambda name: f"/bin/{name}" if have[name] else None
    )
    monkeypatch.setattr(process, "runc_unavailable_reason", lambda: None if have["runc"] else "no")
    monkeypatch.setattr(process.os, "geteuid", lambda: 0)
    assert choose_runtime()[0] == "runc"
    have["runc"] = False
    assert choose_runtime() == ("namespace", "not runc: no")
    monkeypatch.setattr(process.os, "geteuid", lambda: 1000)
    kind, why = choose_runtime()
    assert kind == "preload" and "need root" in why
    with pytest.raises(ValueError, match=r"runtime namespace cannot run here: .*root"):
        choose_runtime("namespace")
    with pytest.raises(ValueError, match=r"unknown runtime 'docker'"):
        choose_runtime("docker")


def test_preload_maps_container_paths_to_the_host() -> None:
    mounts = [
        Mount("/etc/vgpu/libvgpu.so", "/h/lib/libvgpu.so.1", True),
        Mount("/etc/vgpu/limits", "/h/limits/a1", True),
        Mount("/tmp/vgpu", "/h/containers/a1", False),
        Mount("/tmp/vgpulock", "/h/locks", False),
    ]
    assert host_path(mounts, "/tmp/vgpu/a1.cache") == "/h/containers/a1/a1.cache"
    assert host_path(mounts, "/tmp/vgpulockx") == "/tmp/vgpulockx"  # not under /tmp/vgpulock
    envs = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/vgpu/a1.cache", "CUDA_OVERSUBSCRIBE": "false"}
    env = preload_env(ContainerConfig("c", ["true"], envs, mounts))
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/h/containers/a1/a1.cache"
    assert env["CUDA_OVERSUBSCRIBE"] == "false"
    assert env["LD_PRELOAD"] == "/h/lib/libvgpu.so.1"
    assert env["VGPU_LIMITS_FILE"] == "/h/limits/a1"
    assert env["VGPU_LOCK_DIR"] == "/h/locks"
    assert "VGPU_COMPUTE_PEERS" not in env  # no guarantee: no peers mount
    peers = Mount("/etc/vgpu/peers", "/h/containers", True)
    env = preload_env(ContainerConfig("c", ["true"], envs, [*mounts, peers]))
    assert env["VGPU_COMPUTE_PEERS"] == "/h/containers"


def test_without_the_simulator_the_demo_says_so(tmp_path: Path) -> None:
    """The DaemonSet image ships without vgpu_plugin.sim: one clear line, exit 2."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _NoSim:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vgpu_plugin.sim' or name.startswith('vgpu_plugin.sim.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, _NoSim())\n"
    )
    import os

    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "demo"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "simulator is not part of this install" in proc.stderr
    help_ = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "--help"], capture_output=True, text=True, env=env
    )
    assert help_.returncode == 0 and "demo" in help_.stdout  # the rest of the CLI works


def no_torch_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot find torch (sys.modules['torch'] = None)."""
    import os

    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    return {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}


def test_inference_demo_without_torch_says_so_in_one_line(tmp_path: Path) -> None:
    env = no_torch_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "demo", "--inference"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3  # documented in the flag's help and docs/quickstart.md
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "PyTorch is not installed" in proc.stderr
    assert "'.[torch]'" in proc.stderr  # names the extra


@pytest.mark.slow
def test_plain_demo_runs_without_torch(tmp_path: Path, native_tree: Path) -> None:
    """The README's first command needs no PyTorch."""
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "demo", "--seconds", "2"],
        capture_output=True, text=True, env=no_torch_env(tmp_path), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[5/5] what each limit did" in proc.stdout


@pytest.mark.slow
def test_inference_demo_packs_four_servers_on_one_gpu(native_tree: Path) -> None:
    """Four pods on one 16 GiB GPU: three size their KV caches to their slices (within 2 %
    of what the slice allows), the fourth asks for more and gets a clean out-of-memory error,
    and the others go on serving after it."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install -e '.[test,torch]')")
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "demo", "--inference", "--seconds", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("      ")}
    for pod in ("llm-a", "llm-b", "llm-c"):
        cells = rows[pod]
        assert cells[1] == "4096" and cells[-1] == "serving"
        assert 98.0 <= float(cells[5].rstrip("%")) <= 100.0  # cache of what the slice allows
        assert int(cells[-2]) > 4  # served beyond the first four requests
    assert " ".join(rows["greedy"]).endswith("asked 6144 MiB: out of memory")
    proved = [line for line in out.splitlines() if line.startswith("proved: ")]
    assert len(proved) == 1 and "4 inference pods share one 16 GiB GPU" in proved[0]
    assert int(proved[0].split("kept serving (")[1].split()[0]) > 0


# --- demo --compute ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("runtime", list(HOW))
def test_compute_demo_shows_the_guarantee_held_and_idle_time_lent(
    runtime: str, native_tree: Path
) -> None:
    """The shares it prints are simgpu's record's; with today's time-slicing (compute: none)
    steady gets 25 % and the demo fails, with a cap (proportional) noisy alone gets 50 %."""
    if REASONS[runtime]:
        pytest.skip(f"{runtime}: {REASONS[runtime]}")
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "demo", "--compute", "--seconds", "2",
         "--runtime", runtime],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert HOW[runtime] in out.splitlines()[0]
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]"):
        assert step in out
    steady = float(re.search(r"steady got ([\d.]+)% of the GPU's busy time", out)[1])  # type: ignore[index]
    lent = float(re.search(r"noisy ran ([\d.]+)% of the GPU", out)[1])  # type: ignore[index]
    assert abs(steady - 50) <= 5 and lent >= 75, out
    proved = [line for line in out.splitlines() if line.startswith("proved: ")]
    assert len(proved) == 1 and "guarantee holds" in proved[0]


MS = 1_000_000


def _steps(*phases: tuple[int, dict[int, int]]) -> list[dict[int, int]]:
    """(steps, busy ns per pid in each step) phase after phase: a made-up record."""
    return [dict(busy) for n, busy in phases for _ in range(n)]


def test_compute_demo_judges_the_shares_of_simgpus_record() -> None:
    steady, n1, n2, n3 = 100, 201, 202, 203
    step = compute_demo.STEP_NS
    # 2 s both busy, then 1.5 s noisy alone; the step's 20 ms split as named.
    both = (100, {steady: 10 * MS, n1: 4 * MS, n2: 3 * MS, n3: 3 * MS})
    alone = (75, {n1: 7 * MS, n2: 6 * MS, n3: 6 * MS})
    good = _steps(both, alone)
    r = compute_demo.measure(good, 0, 50)
    assert (round(r.steady), round(r.lent)) == (50, 95) and r.held
    assert compute_demo.report(r)[-1].startswith("proved: ")
    # Time-slicing: four processes, a quarter each; a cap: noisy alone at its 50 %.
    sliced = _steps((100, {steady: 5 * MS, n1: 5 * MS, n2: 5 * MS, n3: 5 * MS}), alone)
    capped = _steps(both, (75, {n1: 4 * MS, n2: 3 * MS, n3: 3 * MS}))
    for bad, line in ((sliced, 0), (capped, 1)):
        r = compute_demo.measure(bad, 0, 50)
        assert not r.held
        text = compute_demo.report(r)
        assert ("OFF its guarantee", "NOT lent")[line] in text[line]
        assert text[-1].startswith("NOT proved: ")
    assert step == 20 * MS
    with pytest.raises(RuntimeError, match="too short to measure"):
        compute_demo.measure(_steps((10, {steady: MS, n1: MS}), (60, {n1: MS})), 0, 50)
