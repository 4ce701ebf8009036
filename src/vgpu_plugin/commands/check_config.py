"""``vgpu-plugin check-config FILE``: validate a config and show what it would do on a node.

The plan is computed for the GPUs NVML sees here; where NVML is not available (an admin's
laptop, CI), for a hypothetical node given by ``--gpus/--gpu-model/--gpu-memory``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vgpu_plugin.api.constants import MAX_MESSAGE_BYTES
from vgpu_plugin.commands.serve_dra import split_gpus
from vgpu_plugin.core import dra
from vgpu_plugin.core.config import Config, ConfigError, load_config
from vgpu_plugin.core.devices import MIB, GpuPlan, NodePlan, PhysicalGpu, plan_node
from vgpu_plugin.core.named_config import (
    CONFIG_LABEL,
    NamedConfigError,
    config_file_for,
    missing_config,
    selected_config_name,
)
from vgpu_plugin.core.plan_text import render_dra, render_plan
from vgpu_plugin.core.sizes import parse_size
from vgpu_plugin.kubelet.backend import ListTooLargeError, check_list_size
from vgpu_plugin.kubelet.plugin import advertised_devices
from vgpu_plugin.node.gpu.nvml import NvmlUnavailable, discover, nvml_session
from vgpu_plugin.node.serving.config_watch import NodeLabelsError, read_node_labels


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the config file to check")
    p.add_argument("--node-name", default="", help="node name for overrides")
    p.add_argument("--node-labels-file", help="node labels (key=value lines) for overrides")
    p.add_argument("--gpus", type=int, default=1, help="without NVML: number of GPUs")
    p.add_argument("--gpu-model", default="NVIDIA H100 80GB HBM3", help="without NVML: model")
    p.add_argument("--gpu-memory", default="81559m", help="without NVML: memory per GPU")
    p.add_argument("--no-nvml", action="store_true", help="use the hypothetical node even here")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")


MAX_GPUS = 1024
EXIT_USAGE = 2


def _hypothetical(args: argparse.Namespace, memory: int) -> list[PhysicalGpu]:
    return [
        PhysicalGpu(
            i,
            f"GPU-00000000-0000-0000-0000-{i:012d}",
            args.gpu_model,
            memory,
            i,
            f"00000000:{i + 1:02X}:00.0",
            None,
        )
        for i in range(args.gpus)
    ]


def _usage_problem(args: argparse.Namespace) -> str | None:
    """Why the hypothetical node's flags are wrong, or None."""
    if not 0 <= args.gpus <= MAX_GPUS:
        return f"--gpus: must be 0..{MAX_GPUS}, got {args.gpus}"
    try:
        memory = parse_size(args.gpu_memory, "--gpu-memory")
    except ValueError as exc:
        return str(exc)
    if memory < 1 << 20:
        return f"--gpu-memory: must be at least 1m, got {args.gpu_memory!r}"
    return None


def _picked_file(given: Path, labels: Mapping[str, str]) -> str:
    """The file serve would run with these labels: ``given``, or the named config beside it
    that the label ``vgpu-plugin.io/config`` picks (said on stderr)."""
    name = selected_config_name(labels)
    if name is None:
        return str(given)
    picked = config_file_for(given, name)
    if not picked.exists():
        raise missing_config(given, name)
    print(f"node label {CONFIG_LABEL}={name}: checking {picked}, as serve would run it",
          file=sys.stderr)  # fmt: skip
    return str(picked)


def run(args: argparse.Namespace) -> int:
    problem = _usage_problem(args)
    if problem is not None:
        print(f"vgpu-plugin check-config: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        labels = read_node_labels(Path(args.node_labels_file) if args.node_labels_file else None)
        args.file = _picked_file(Path(args.file), labels)
        config = load_config(Path(args.file))
    except NamedConfigError as exc:
        print(f"vgpu-plugin check-config: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, NodeLabelsError) as exc:
        print(f"{args.file}: invalid\n{exc}", file=sys.stderr)
        return 1
    source = "this node (NVML)"
    gpus: list[PhysicalGpu] = []
    if not args.no_nvml:
        try:
            with nvml_session():
                gpus = discover()
        except NvmlUnavailable:
            gpus = []
    if not gpus:
        gpus = _hypothetical(args, parse_size(args.gpu_memory))
        source = f"a hypothetical node of {args.gpus} x {args.gpu_model} (no NVML here)"
    # Both front ends, as serve splits the GPUs: dra.gpus are the DRA driver's, the rest the
    # device plugin's.
    plugin_gpus, dra_gpus = split_gpus(config, gpus)
    plan = plan_node(config, plugin_gpus, args.node_name, labels)
    problem = None
    size = None
    try:
        size = check_list_size(advertised_devices(plan, {}))
    except ListTooLargeError as exc:
        problem = f"but it cannot be served: {exc}"
    if args.json:
        doc = plan_document(config, plan, dra_gpus, source, size, problem)
        print(json.dumps({"file": args.file, **doc}, indent=2))
        return 0 if problem is None else 1
    print(f"{args.file}: valid. Plan for {source}:")
    print(render_plan(plan))
    if config.dra.enabled:
        print(render_dra(config.dra, dra_gpus))
        for warning in dra.policy_warnings(dra.CapacityPolicy(*config.dra.memory)):
            print(f"warning: {warning}", file=sys.stderr)
    for line in config.ignored_flags:
        print(f"NVIDIA flag {line}")
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    print(f"ListAndWatch message: {size} bytes (limit {MAX_MESSAGE_BYTES})")
    return 0


def _gpu(g: GpuPlan) -> dict[str, Any]:
    sharing = g.sharing
    return {
        "index": g.gpu.index,
        "model": g.gpu.name,
        "uuid": g.gpu.uuid,
        "memoryMiB": g.gpu.memory_mib,
        "splitCount": sharing.split_count,
        "sliceMemoryMiB": g.slice_memory_mib,
        "sliceComputePercent": g.slice_compute_percent,  # 0: not limited
        "compute": sharing.compute,
        # guaranteed: sliceComputePercent is each slice's guarantee, this the cap
        "computeLimit": sharing.compute_limit if sharing.compute == "guaranteed" else None,
        "memoryScaling": float(sharing.memory_scaling),
        "oversubscribed": sharing.oversubscribed,
        "placement": sharing.placement,
        "override": g.override,  # index into overrides; null: the base sharing
        "slices": [s.id for s in g.slices],
    }


def plan_document(
    config: Config,
    plan: NodePlan,
    dra_gpus: Sequence[PhysicalGpu],
    source: str,
    list_bytes: int | None,
    problem: str | None,
) -> dict[str, Any]:
    """The plan the text output shows, as data (docs/configuration.md#check-config---json)."""
    dra_doc: dict[str, Any] | None = None
    if config.dra.enabled:
        mem_default, mem_min, mem_step = (v // MIB for v in config.dra.memory)
        cpu_default, cpu_min, cpu_step = config.dra.compute
        dra_doc = {
            "driverName": config.dra.driver_name,
            "gpuSelectors": list(config.dra.gpus),
            "gpus": [
                {"index": g.index, "model": g.name, "uuid": g.uuid, "memoryMiB": g.memory_mib}
                for g in sorted(dra_gpus, key=lambda g: g.index)
            ],
            "claimMemoryMiB": {"default": mem_default, "min": mem_min, "step": mem_step},
            "claimComputePercent": {"default": cpu_default, "min": cpu_min, "step": cpu_step},
            "warnings": list(dra.policy_warnings(dra.CapacityPolicy(*config.dra.memory))),
        }
    return {
        "valid": True,
        "servable": problem is None,
        "problem": problem,
        "source": source,
        "frontEnds": ["device-plugin", "dra"] if dra_doc is not None else ["device-plugin"],
        "devicePlugin": {
            "resourceName": plan.resource_name,
            "placement": plan.placement,
            "failRequestsGreaterThanOne": plan.fail_requests_greater_than_one,
            "slices": len(plan.all_slices()),
            "gpus": [_gpu(g) for g in plan.gpus],
            "listAndWatchBytes": list_bytes,
            "listAndWatchLimitBytes": MAX_MESSAGE_BYTES,
        },
        "dra": dra_doc,
        "ignoredFlags": list(config.ignored_flags),
    }
