"""The ``vgpu-plugin`` command line. Each command's work lives in its own module."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

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


def version_text() -> str:
    """``vgpu-plugin <version> (shim <build id>)``: the build id is the name install-shim gives
    the shim this package carries (what Allocate mounts), ``none`` without one."""
    from vgpu_plugin.node.observe.metrics import build_ids

    version, shim = build_ids()
    return f"vgpu-plugin {version} (shim {shim})"


class _Version(argparse.Action):
    """``--version``, its text made only when asked (it hashes the shim)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS)
        self.help = "print the version and the shim's build id, and exit"

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_text())  # to stdout, as argparse's own version action does
        parser.exit()


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, where it has one worth showing (not None, not a
    switch's False) and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        if not action.option_strings or isinstance(action.default, list):
            return text
        return text + " (default: %(default)s)"


# (name, one-line help in the command list, description atop the command's own help)
COMMANDS: tuple[tuple[str, str, str], ...] = (
    (
        "serve",
        "run the device plugin (the DaemonSet's command)",
        "Run the device plugin (and the DRA driver where the config enables it): register\n"
        "with the kubelet, answer Allocate, serve metrics. Each flag also reads its\n"
        "environment variable; a flag given wins.",
    ),
    (
        "check-config",
        "validate a config file and print the per-GPU plan",
        "Validate a config file as serve would and print the plan for this node's GPUs\n"
        "(NVML) or for a hypothetical node (--gpus, --gpu-model, --gpu-memory).",
    ),
    (
        "status",
        "show the node's GPUs, slices and containers",
        "Show the node's GPUs, slices and containers from the plugin's state dir, its\n"
        "host root, the kubelet and NVML; read-only, whether or not the plugin runs.\n"
        "Exit 1 when the state dir or host root is not there.",
    ),
    (
        "install-shim",
        "install the shim and ld.so.preload into the host root",
        "Install this package's shim and ld.so.preload into the host root (the\n"
        "DaemonSet's init container), keeping older versions that containers may mount.",
    ),
    (
        "demo",
        "run a whole simulated GPU node and show the limits at work",
        "Run a simulated GPU node with the real plugin and shim, start a few pods on it\n"
        "and show each limit holding (docs/quickstart.md explains the columns).",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    from vgpu_plugin.commands import check_config, demo, status
    from vgpu_plugin.commands import install_shim as install

    parser = argparse.ArgumentParser(
        prog="vgpu-plugin", description="Fractional GPU sharing for Kubernetes."
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    flags: dict[str, Callable[[argparse.ArgumentParser], None]] = {
        "serve": add_serve_flags,
        "check-config": check_config.add_flags,
        "status": status.add_flags,
        "install-shim": install.add_flags,
        "demo": demo.add_flags,
    }
    handlers: dict[str, Handler] = {
        "serve": _serve,
        "check-config": _check_config,
        "status": _status,
        "install-shim": _install_shim,
        "demo": _demo,
    }
    for name, short, description in COMMANDS:
        p = sub.add_parser(name, help=short, description=description, formatter_class=_Help)
        flags[name](p)
        p.set_defaults(handler=handlers[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # serve forks a child for each metrics build (node/observe/metrics.py); gRPC's fork handlers,
    # on by default, would log a line at each one and are of no use to a child that never
    # calls gRPC. Read once, when gRPC is first imported: before the parser imports it.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)
