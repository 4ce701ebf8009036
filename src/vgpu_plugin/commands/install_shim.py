"""``vgpu-plugin install-shim``: the DaemonSet's init container installs the shim and
ld.so.preload into the host root (the work is node/host/install.py's)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vgpu_plugin.commands.settings import add_shared_flag
from vgpu_plugin.core.defaults import HOST_ROOT
from vgpu_plugin.node.host import native
from vgpu_plugin.node.host.install import ForeignPreload, describe, install_shim, live_since

EXIT_FOREIGN_PRELOAD = 3  # the node: another tool's ld.so.preload in this host root


def add_flags(p: argparse.ArgumentParser) -> None:
    add_shared_flag(
        p, "host-root", "where the shim, ld.so.preload, limits/ and containers/ go", HOST_ROOT
    )
    p.add_argument("--source", help="the shim to install (default: the one in this package)")
    p.add_argument(
        "--keep",
        type=int,
        help="remove older versions beyond the newest KEEP that no allocation can still use",
    )
    add_shared_flag(
        p, "state-dir", "the plugin's records, to tell which versions may be in use (with --keep)"
    )
    p.add_argument(
        "--replace-preload",
        action="store_true",
        help="replace an ld.so.preload that lists another tool's library (refused without)",
    )


def run(args: argparse.Namespace) -> int:
    root = Path(args.host_root)
    if args.keep is not None and args.keep < 1:
        print("install-shim: --keep must be at least 1", file=sys.stderr)
        return 2
    since = live_since(root, Path(args.state_dir)) if args.keep is not None else None
    try:
        result = install_shim(
            root,
            Path(args.source) if args.source else None,
            args.keep,
            since,
            replace_preload=args.replace_preload,
        )
    except ForeignPreload as exc:
        print(f"install-shim: {exc}", file=sys.stderr)
        return EXIT_FOREIGN_PRELOAD
    except (OSError, native.NativeArtifactMissing) as exc:
        print(f"install-shim: {exc}", file=sys.stderr)
        return 1
    print(describe(result))
    return 0
