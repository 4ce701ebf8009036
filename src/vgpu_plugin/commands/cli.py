"""The ``vgpu-plugin`` command line. Each command's work lives in its own module."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from vgpu_plugin import __version__
from vgpu_plugin.commands.settings import add_serve_flags

Handler = Callable[[argparse.Namespace], int]


def _serve(args: argparse.Namespace) -> int:
    from vgpu_plugin.commands import serve
    from vgpu_plugin.commands.settings import settings_from

    return serve.run(settings_from(args))


def _check_config(args: argparse.Namespace) -> int:
    from vgpu_plugin.commands import check_config

    return check_config.run(args)


def _status(args: argparse.Namespace) -> int:
    from vgpu_plugin.commands import status

    return status.run(args)


def _install_shim(args: argparse.Namespace) -> int:
    from vgpu_plugin.commands import install_shim as install

    return install.run(args)


def _demo(args: argparse.Namespace) -> int:
    from vgpu_plugin.commands import demo as run

    return run.run(args)


def build_parser() -> argparse.ArgumentParser:
    from vgpu_plugin.commands import check_config, demo, status
    from vgpu_plugin.commands import install_shim as install

    parser = argparse.ArgumentParser(
        prog="vgpu-plugin", description="Fractional GPU sharing for Kubernetes."
    )
    parser.add_argument("--version", action="version", version=f"vgpu-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("serve", help="run the device plugin (the DaemonSet's command)")
    add_serve_flags(p)
    p.set_defaults(handler=_serve)

    p = sub.add_parser("check-config", help="validate a config file and print the per-GPU plan")
    check_config.add_flags(p)
    p.set_defaults(handler=_check_config)

    p = sub.add_parser("status", help="show the node's GPUs, slices and containers")
    status.add_flags(p)
    p.set_defaults(handler=_status)

    p = sub.add_parser("install-shim", help="install the shim and ld.so.preload into the host root")
    install.add_flags(p)
    p.set_defaults(handler=_install_shim)

    p = sub.add_parser("demo", help="run a whole simulated GPU node and show the limits at work")
    demo.add_flags(p)
    p.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # serve forks a child for each metrics build (node/metrics.py); gRPC's fork handlers,
    # on by default, would log a line at each one and are of no use to a child that never
    # calls gRPC. Read once, when gRPC is first imported: before the parser imports it.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)
