"""Container images for the cluster tier, built without a registry.

- ``vgpu-plugin:cluster-test``: Debian bookworm (``debootstrap --variant=minbase
  --include=python3``, cached under build/cluster/) plus the project's wheel and its
  dependency wheels (``pip wheel`` of this checkout with its ``dra`` extra), installed offline
  into the root filesystem's dist-packages. It is the plugin's image as the chart runs it, and
  the workload pods' image (python3 over simgpu's libcuda through ctypes).
- ``vgpu-plugin:cluster-test-next``: the same layers plus one small layer holding a second
  build of the shim (``libvgpu.so``, built by native/'s CMake with another ELF build id, so a
  different file with a different install-shim version): the "new shim version" a rolling
  upgrade of the DaemonSet installs beside the old one. Both tags are in one archive, which
  holds the shared layers once.
- ``registry.k8s.io/pause:3.10``: a static ``pause`` (a few lines of C), containerd's pinned
  sandbox image.

Each is written as a docker-archive tarball (``ctr images import`` reads it). Layers are cached:
the base rootfs once, the wheel layer and the second shim's layer per content hash of src/,
native/, pyproject.toml and this recipe.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from .assets import CACHE, ROOT

PLUGIN_IMAGE = "vgpu-plugin:cluster-test"
NEXT_TAG = "cluster-test-next"
NEXT_IMAGE = f"vgpu-plugin:{NEXT_TAG}"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
SITE = "usr/lib/python3/dist-packages"
SHIM = f"{SITE}/vgpu_plugin/_native/lib/libvgpu.so"
PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
static void quit(int s) { (void)s; _exit(0); }
int main(void) {
    signal(SIGINT, quit);
    signal(SIGTERM, quit);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


@dataclass(frozen=True)
class Images:
    tarballs: tuple[Path, ...]
    native_dir: Path  # the wheel's vgpu_plugin/_native: simgpu's libraries for the node
    seconds: float  # build time of this call (cached parts are cheap)
    shim: Path  # the shim PLUGIN_IMAGE ships
    next_shim: Path  # the other build of it, NEXT_IMAGE's


def _run(cmd: list[str], **kw: object) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def base_rootfs() -> Path:
    """Debian bookworm minbase with python3 (minutes the first time, then cached)."""
    out = CACHE / "rootfs-bookworm-python3"
    if (out / "usr" / "bin" / "python3").exists():
        return out
    tmp = CACHE / "rootfs-bookworm-python3.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3",
            "bookworm",
            str(tmp),
            "http://deb.debian.org/debian",
        ]
    )
    tmp.rename(out)
    return out


def _layer_from_dir(src: Path, out: Path) -> None:
    # Device nodes, /proc and /sys stay empty: the runtime provides them.
    _run(
        [
            "tar",
            "-C",
            str(src),
            "--numeric-owner",
            "--exclude=./dev/*",
            "--exclude=./proc/*",
            "--exclude=./sys/*",
            "-cf",
            str(out),
            ".",
        ]
    )


def _source_hash() -> str:
    h = hashlib.sha256()
    files = [ROOT / "pyproject.toml", Path(__file__).resolve()]
    for top in ("src", "native"):
        files += sorted(
            p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _app_layer(layers: Path) -> tuple[Path, Path]:
    """The wheel layer and the staged tree's _native dir, built once per source hash."""
    key = _source_hash()
    stage = layers / f"app-{key}"
    layer = layers / f"app-{key}.tar"
    native = stage / SITE / "vgpu_plugin" / "_native"
    if layer.exists() and native.is_dir():
        return layer, native
    wheels = layers / f"wheels-{key}"
    shutil.rmtree(wheels, ignore_errors=True)
    # With the dra extra, as the image's default build (DRA=true): the tier runs the driver.
    _run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), f"{ROOT}[dra]"])
    shutil.rmtree(stage, ignore_errors=True)
    site = stage / SITE
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels),
            "--target",
            str(site),
            "--no-compile",
            "vgpu-plugin[dra]",
        ]
    )
    shutil.rmtree(site / "bin", ignore_errors=True)
    bindir = stage / "usr" / "local" / "bin"
    bindir.mkdir(parents=True)
    script = bindir / "vgpu-plugin"
    script.write_text(
        "#!/usr/bin/python3\nimport sys\nfrom vgpu_plugin.commands.cli import main\n"
        "sys.exit(main())\n"
    )
    script.chmod(0o755)
    _layer_from_dir(stage, layer)
    shutil.rmtree(wheels, ignore_errors=True)
    return layer, native


def _next_shim_layer(layers: Path, key: str) -> tuple[Path, Path]:
    """A layer that replaces the image's shim with a second build of the same source: native/'s
    CMake as the wheel runs it, the linker given another ELF build id (derived from ``key``, so
    a cached layer stays valid). Only the ``vgpu`` target: seconds, once per source hash."""
    stage = layers / f"shim-next-{key}"
    layer = layers / f"shim-next-{key}.tar"
    shim = stage / SHIM
    if layer.exists() and shim.is_file():
        return layer, shim
    work = layers / f"shim-next-{key}.build"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(stage, ignore_errors=True)
    build_id = hashlib.sha1(f"{NEXT_IMAGE} {key}".encode()).hexdigest()
    _run(
        [
            "cmake",
            "-S",
            str(ROOT / "native"),
            "-B",
            str(work),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DVGPU_BUILD_TESTS=OFF",
            "-DVGPU_BUILD_SIMGPU=OFF",
            f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--build-id=0x{build_id}",
        ]
    )
    _run(["cmake", "--build", str(work), "--target", "vgpu"])
    shim.parent.mkdir(parents=True)
    shutil.copy2(work / "lib" / "libvgpu.so", shim)
    shim.chmod(0o755)
    shutil.rmtree(work, ignore_errors=True)
    _layer_from_dir(stage, layer)
    return layer, shim


def _pause_layer(layers: Path) -> Path:
    layer = layers / "pause.tar"
    if layer.exists():
        return layer
    stage = layers / "pause"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    (stage / "pause.c").write_text(PAUSE_C)
    _run(["gcc", "-static", "-O2", "-o", str(stage / "pause"), str(stage / "pause.c")])
    (stage / "pause.c").unlink()
    _layer_from_dir(stage, layer)
    return layer


def _docker_archive(
    out: Path, images: list[tuple[str, list[Path]]], cmd: list[str], env: list[str]
) -> None:
    """Images as `docker save` writes them: manifest.json (one entry per tag), a config per
    image, one tar per layer, stored once however many images share it."""
    diff_ids = {layer: _sha256(layer) for _, layers in images for layer in layers}
    configs: dict[str, bytes] = {}
    entries = []
    for tag, layers in images:
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Env": env, "Cmd": cmd, "WorkingDir": "/"},
                "rootfs": {
                    "type": "layers",
                    "diff_ids": [f"sha256:{diff_ids[layer]}" for layer in layers],
                },
            }
        ).encode()
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        configs[config_name] = config
        entries.append(
            {
                "Config": config_name,
                "RepoTags": [tag],
                "Layers": [f"{diff_ids[layer]}/layer.tar" for layer in layers],
            }
        )
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for layer, d in diff_ids.items():
            tar.add(layer, arcname=f"{d}/layer.tar")
        files = [*configs.items(), ("manifest.json", json.dumps(entries).encode())]
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(out)


def build() -> Images:
    t0 = time.monotonic()
    layers = CACHE / "layers"
    layers.mkdir(parents=True, exist_ok=True)
    base = layers / "base.tar"
    if not base.exists():
        _layer_from_dir(base_rootfs(), base.with_suffix(".tmp"))
        base.with_suffix(".tmp").rename(base)
    app, native = _app_layer(layers)
    key = app.stem.removeprefix("app-")
    next_layer, next_shim = _next_shim_layer(layers, key)
    pause = _pause_layer(layers)
    images = CACHE / "images"
    images.mkdir(exist_ok=True)
    plugin_tar = images / f"plugin-{app.stem}-next.tar"
    if not plugin_tar.exists():
        for old in images.glob("plugin-*.tar"):
            old.unlink()
        path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        plugin = [(PLUGIN_IMAGE, [base, app]), (NEXT_IMAGE, [base, app, next_layer])]
        _docker_archive(plugin_tar, plugin, ["/bin/sh"], [path])
    pause_tar = images / "pause.tar"
    if not pause_tar.exists():
        _docker_archive(pause_tar, [(PAUSE_IMAGE, [pause])], ["/pause"], [])
    for pattern in ("app-*", "shim-next-*"):
        for old in layers.glob(pattern):
            if key not in old.name:
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    return Images(
        (pause_tar, plugin_tar),
        native,
        time.monotonic() - t0,
        shim=native / "lib" / "libvgpu.so",
        next_shim=next_shim,
    )
