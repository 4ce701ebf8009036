"""The ``vgpu-plugin`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from vgpu_plugin import __version__

Handler = Callable[[argparse.Namespace], int]


def _not_yet(name: str) -> Handler:
    def run(_: argparse.Namespace) -> int:
        print(f"vgpu-plugin {name}: not yet implemented in this version", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgpu-plugin", description="Fractional GPU sharing for Kubernetes."
    )
    parser.add_argument("--version", action="version", version=f"vgpu-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, text in (
        ("demo", "run a whole simulated GPU node and show the limits at work"),
        ("serve", "run the device plugin (the DaemonSet's command)"),
        ("status", "show the node's GPUs, slices and containers"),
        ("check-config", "validate a config file and print the per-GPU plan"),
        ("install-shim", "install the shim and ld.so.preload into the host root"),
    ):
        p = sub.add_parser(name, help=text)
        p.set_defaults(handler=_not_yet(name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)
