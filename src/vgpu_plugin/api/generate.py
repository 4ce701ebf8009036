"""Regenerates the Python modules of the kubelet protos.

Run from anywhere: ``python -m vgpu_plugin.api.generate`` (needs grpcio-tools, a test extra).

The protos are compiled with ``src/`` as the include root, so each one is registered under
its package path (``vgpu_plugin/api/deviceplugin/v1beta1/api.proto``) and the generated
``*_pb2_grpc.py`` already imports its messages as ``vgpu_plugin.api....api_pb2``: no import
line needs rewriting, and the files all named ``api.proto`` cannot clash in protobuf's
descriptor pool. The outputs are committed; tests/kubelet/test_api_stubs.py regenerates
them into a temporary directory and fails if they differ from the committed ones.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

API_DIR = Path(__file__).resolve().parent
SRC_ROOT = API_DIR.parent.parent
PROTOS = (
    Path("vgpu_plugin/api/deviceplugin/v1beta1/api.proto"),
    Path("vgpu_plugin/api/podresources/v1/api.proto"),
    Path("vgpu_plugin/api/pluginregistration/v1/api.proto"),
    Path("vgpu_plugin/api/dra/v1/api.proto"),
    Path("vgpu_plugin/api/dra/v1beta1/api.proto"),
    Path("vgpu_plugin/api/drahealth/v1alpha1/api.proto"),
)
OUTPUT_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def outputs(root: Path) -> list[Path]:
    """The generated files, under ``root``, that the protos produce."""
    return [
        root / proto.parent / (proto.stem + suffix)
        for proto in PROTOS
        for suffix in OUTPUT_SUFFIXES
    ]


def generate(out_root: Path = SRC_ROOT) -> list[Path]:
    """Compiles every proto into ``out_root`` (default: the source tree); returns the files."""
    # Imported here: grpcio-tools is a build/test tool, not a runtime dependency.
    protoc = importlib.import_module("grpc_tools.protoc")
    out_root.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        (out_root / proto.parent).mkdir(parents=True, exist_ok=True)
        args = [
            "protoc",
            f"-I{SRC_ROOT}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return outputs(out_root)


def main() -> int:
    for path in generate():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
