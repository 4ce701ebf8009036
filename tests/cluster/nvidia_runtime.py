"""The NVIDIA container runtime's part for the cluster tier: containerd's runc, wrapped.

On a GPU node the toolkit's runtime (nvidia-container-runtime) turns a container's request for
GPUs into the edits of its CDI spec before runc runs. With the safe settings the plugin's docs
ask for (docs/security.md: accept-nvidia-visible-devices-as-volume-mounts) the request is a
mount at ``/var/run/nvidia-container-devices/<id>`` (``all``, a UUID or an index), which is how
the chart's DaemonSet asks for every GPU for NVML and how the device plugin's volume-mounts
strategy names a container's GPUs. So on ``create`` this reads the bundle's config.json, applies
the stand-in spec's edits (``kind: nvidia.com/gpu``, written by cluster.py: simgpu's libraries
and state) for each such id, and then execs runc with the same arguments. CDI device names
(DRA, cdi-cri) are applied by containerd itself from the same spec.

Usage (containerd's BinaryName, through a two-line shell wrapper):
``nvidia_runtime.py SPEC.json RUNC runc-args...``. Standard library only.
"""

from __future__ import annotations

import json
import os
import sys

PREFIX = "/var/run/nvidia-container-devices/"


def _bundle(args: list[str]) -> str | None:
    if "create" not in args:
        return None
    for i, a in enumerate(args):
        if a == "--bundle" or a == "-b":
            return args[i + 1]
        if a.startswith("--bundle="):
            return a.split("=", 1)[1]
    return os.getcwd()


def apply(config: dict, spec: dict) -> dict:
    ids = [
        m["destination"][len(PREFIX) :]
        for m in config.get("mounts", [])
        if m.get("destination", "").startswith(PREFIX)
    ]
    if not ids:
        return config
    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    edits = [spec.get("containerEdits", {})]
    for i in ids:
        if i not in devices:
            raise SystemExit(f"nvidia runtime stand-in: unknown GPU {i!r}")
        edits.append(devices[i])
    process = config.setdefault("process", {})
    env = process.setdefault("env", [])
    for e in edits:
        for item in e.get("env", []):
            key = item.split("=", 1)[0] + "="
            env[:] = [x for x in env if not x.startswith(key)] + [item]
        for m in e.get("mounts", []):
            config["mounts"].append(
                {
                    "destination": m["containerPath"],
                    "source": m["hostPath"],
                    "type": "bind",
                    "options": m.get("options", ["rbind"]),
                }
            )
    return config


def main(argv: list[str]) -> int:
    spec_path, runc, *args = argv
    bundle = _bundle(args)
    if bundle is not None:
        path = os.path.join(bundle, "config.json")
        with open(path) as f:
            config = json.load(f)
        with open(spec_path) as f:
            spec = json.load(f)
        config = apply(config, spec)
        with open(path, "w") as f:
            json.dump(config, f)
    os.execv(runc, [runc, *args])
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
