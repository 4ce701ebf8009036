"""The whole node: pod -> kubelet -> Allocate -> runc container -> every process limited.

Each test runs real containers under runc whose /etc/ld.so.preload loads the shim, on a
simulated GPU node, with the real plugin process and the kubelet emulator.
"""

from __future__ import annotations

import json
import shlex
import time

from e2e.helpers import NodeFactory, gpu_share, needs_containers, one, results

from vgpu_plugin.sim.node import MIB, WORKLOAD

pytestmark = needs_containers

PY = " ".join(shlex.quote(w) for w in WORKLOAD)


def parallel(n: int, command: str) -> list[str]:
    """A container command running ``n`` workload processes at once."""
    return ["sh", "-c", " ".join([f"{PY} {command} &"] * n) + " wait"]


def test_two_containers_on_one_gpu_each_hit_their_own_limit(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node()
    small, large = node.admit("small", 1), node.admit("large", 2)
    assert small.gpus == large.gpus
    for pod, limit_mib in ((small, 4096), (large, 8192)):
        assert pod.memory_limit_mib() == limit_mib
        # Three processes racing for the container's memory, holding what they got until all
        # three have raced (at load 15 one started after another had let go of its 2 s hold).
        race = "alloc --target-mib 99999 --chunk-mib 64 --hold 0.2 --barrier /dev/shm/race"
        command = parallel(3, f"{race} --parties 3")
        procs = results(node.run_container(pod, command))
        assert len(procs) == 3
        fed = [p for p in procs if "allocated_mib" in p]
        # A process whose context no longer fits is refused cleanly, never let in.
        assert all("CUDA_ERROR_OUT_OF_MEMORY" in p["error"] for p in procs if p not in fed)
        assert fed and any(p["out_of_memory"] for p in fed)
        used = sum(p["allocated_mib"] for p in fed) + 256 * len(fed)  # each has a context
        assert limit_mib - 64 * len(fed) < used <= limit_mib, procs
        seen = one(node.run_container(pod, [*WORKLOAD, "view"]))
        assert seen["cuda_total"] == seen["device_total"] == limit_mib * MIB
        assert seen["nvml_total"] == limit_mib * MIB


def test_compute_shares_on_one_gpu(make_emulated_node: NodeFactory) -> None:
    node = make_emulated_node()
    quarter, half = node.admit("quarter", 1), node.admit("half", 2)
    t0 = time.monotonic_ns()
    procs = {pod.pod: node.start_container(pod, [*WORKLOAD, "compute", "--seconds", "4"])
             for pod in (quarter, half)}  # fmt: skip
    outs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outs[name] = json.loads(out.strip().splitlines()[-1])
    # Judged by simgpu's record while each launched (a loaded host delays the launchers).
    shares = {name: gpu_share(node, outs[name], t0, limit)
              for name, limit in (("quarter", 25), ("half", 50))}  # fmt: skip
    assert all(r.held for r in shares.values()), shares


def test_a_container_on_two_gpus_sees_both_with_their_limits(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node(gpus=2)
    ids = [d.ID for d in node.devices()]
    gpu0, gpu1 = sorted({i.rsplit("-", 1)[0] for i in ids}, key=lambda u: ids.index(u + "-0"))
    pod = node.admit("wide", 3, [f"{gpu1}-0", f"{gpu0}-2", f"{gpu1}-3"])
    seen = one(node.run_container(pod, [*WORKLOAD, "devices"]))["devices"]
    assert [(d["uuid"], d["total"] // MIB) for d in seen] == [(gpu0, 4096), (gpu1, 8192)]


def test_kubelet_restart_and_plugin_crash_leave_running_containers_alone(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node()
    running = node.admit("running", 1)
    proc = node.start_container(
        running, [*WORKLOAD, "alloc", "--target-mib", "1024", "--hold", "6"]
    )
    node.kubelet.restart()
    node.kubelet.wait_registrations(2, timeout=10)
    node.wait_devices(lambda d: len(d) == 4)
    node.kill_plugin()
    node.start_plugin()
    node.kubelet.wait_registrations(3, timeout=20)
    node.wait_devices(lambda d: len(d) == 4)
    late = node.admit("late", 1)
    assert (
        one(node.run_container(late, [*WORKLOAD, "alloc", "--target-mib", "512"]))["allocated_mib"]
        == 512
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["allocated_mib"] == 1024


def test_a_killed_process_gives_its_memory_back_within_a_second(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node()
    pod = node.admit("pod", 1)
    # Inside one container: a holder takes most of the limit and is SIGKILLed once it says
    # it holds it (its line, not a sleep: a loaded host starts it late); a second process
    # then gets the whole budget back within a second.
    script = (
        f"( {PY} alloc --target-mib 3072 --hold 60 & echo $!; wait ) | "
        '{ read -r holder; read -r held; echo "$held"; kill -9 "$holder"; }; '
        f"sleep 1; {PY} alloc --target-mib 3584 --chunk-mib 512"
    )
    found = results(node.run_container(pod, ["sh", "-c", script]))
    assert found[0]["allocated_mib"] == 3072
    assert found[1]["allocated_mib"] == 3584 and not found[1]["out_of_memory"]


def test_status_sees_a_killed_process_go(make_emulated_node: NodeFactory) -> None:
    node = make_emulated_node()
    pod = node.admit("pod", 1)
    proc = node.start_container(pod, [*WORKLOAD, "alloc", "--target-mib", "2048", "--hold", "60"])
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["allocated_mib"] == 2048

    def used_mib() -> int:
        view = json.loads(node.status("--json").stdout)
        (alloc,) = [a for a in view["allocations"] if a["id"] == pod.allocation_id]
        return int(sum(g["memory_used"] for g in alloc["gpus"]) // MIB)

    assert used_mib() >= 2048
    node.runtime.kill(pod.containers[0])
    # Once the container's process is gone (reaped: its runtime has exited), the very next
    # status counts nothing for it: no timer, no window a loaded host could miss.
    proc.wait(120)
    assert used_mib() == 0, "usage still charged after the process died"


def test_ended_container_dirs_are_cleaned_after_the_grace_period(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node(cleanup_grace=1)
    pod = node.admit("short", 1)
    one(node.run_container(pod, [*WORKLOAD, "alloc", "--target-mib", "256"]))
    alloc_dir = node.host_root / "containers" / pod.allocation_id
    limits = node.host_root / "limits" / pod.allocation_id
    assert alloc_dir.is_dir() and limits.exists()
    node.remove_pod(pod)
    deadline = time.monotonic() + 15
    while alloc_dir.exists() or limits.exists():
        assert time.monotonic() < deadline, node.plugin_log()[-3000:]
        time.sleep(0.1)


def test_split_change_while_pods_run(make_emulated_node: NodeFactory) -> None:
    node = make_emulated_node()
    pod = node.admit("old", 1)
    before = one(node.run_container(pod, [*WORKLOAD, "view"]))
    node.config.write_text("version: v1\nsharing: {splitCount: 8, compute: proportional}\n")
    node.wait_devices(lambda d: len(d) == 8, timeout=15)
    after = one(node.run_container(pod, [*WORKLOAD, "view"]))
    assert after["cuda_total"] == before["cuda_total"] == 4096 * MIB
    new = node.admit("new", 1)
    assert new.memory_limit_mib() == 2048 and new.compute_limit() == 12
