"""The runc harness turns envs and mounts into a real container, as the CRI would."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu_plugin.core.allocation import Mount
from vgpu_plugin.sim.runc import ContainerConfig, RuncRuntime, runc_unavailable_reason

pytestmark = pytest.mark.skipif(
    runc_unavailable_reason() is not None, reason=str(runc_unavailable_reason())
)


def test_preload_envs_and_mount_modes(native_tree: Path, tmp_path: Path) -> None:
    shim = native_tree / "lib" / "libvgpu.so"
    preload = tmp_path / "ld.so.preload"
    preload.write_text("/etc/vgpu/libvgpu.so\n")
    limits = tmp_path / "limits"
    limits.write_text("vgpu-limits 1\n")
    rw = tmp_path / "rw"
    rw.mkdir()
    script = (
        "echo env=$VGPU_ALLOCATION_ID; "
        "grep -c libvgpu.so /proc/self/maps; "
        "echo x > /etc/vgpu/limits 2>/dev/null && echo limits-writable || echo limits-ro; "
        "echo hello > /tmp/vgpu/out && echo rw-ok; "
        "echo $$"
    )
    config = ContainerConfig(
        name="oci-test",
        args=["sh", "-c", script],
        envs={"VGPU_ALLOCATION_ID": "abc123"},
        mounts=[
            Mount("/etc/vgpu/libvgpu.so", str(shim), True),
            Mount("/etc/ld.so.preload", str(preload), True),
            Mount("/etc/vgpu/limits", str(limits), True),
            Mount("/tmp/vgpu", str(rw), False),
        ],
    )
    result = RuncRuntime(tmp_path / "runtime").run(config, timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[0] == "env=abc123"
    assert int(lines[1]) >= 1, "the preloaded shim is not mapped in the container's shell"
    assert lines[2] == "limits-ro"
    assert lines[3] == "rw-ok" and (rw / "out").read_text() == "hello\n"
    assert lines[4] == "1", "the container has no pid namespace of its own"
    assert limits.read_text() == "vgpu-limits 1\n"
    assert not (tmp_path / "runtime" / "oci-test").exists(), "bundle left behind"


def test_a_pod_with_a_read_only_volume_at_usr_starts(native_tree: Path, tmp_path: Path) -> None:
    """The kubelet puts the pod's volumes before the device plugin's mounts; a read-only
    volume at /usr must leave every mount point of ours creatable (issue 14, item 12)."""
    from vgpu_plugin.core.defaults import PRELOAD_PATH, SHIM_PATH

    usr = tmp_path / "usr-volume"
    (usr / "local").mkdir(parents=True)
    preload = tmp_path / "ld.so.preload"
    preload.write_text(f"{SHIM_PATH}\n")
    config = ContainerConfig(
        name="oci-usr-ro",
        args=["/bin/sh", "-c", "grep -c libvgpu.so /proc/self/maps"],
        envs={},
        mounts=[
            Mount("/usr/local", str(usr / "local"), True),  # the pod's read-only volume
            Mount(SHIM_PATH, str(native_tree / "lib" / "libvgpu.so"), True),
            Mount(PRELOAD_PATH, str(preload), True),
        ],
    )
    result = RuncRuntime(tmp_path / "runtime").run(config, timeout=30)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[0]) >= 1
