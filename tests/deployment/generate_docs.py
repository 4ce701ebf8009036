"""The reference tables of docs/, generated from the code they describe.

    python tests/deployment/generate_docs.py          # rewrite the tables in place
    python tests/deployment/generate_docs.py --check  # exit 1 when a table is out of date

Each table sits between ``<!-- generated:NAME -->`` and ``<!-- end:NAME -->`` in its document;
the prose around it is written by hand. ``test_docs.py`` fails when a table differs from what
the code says now: the config keys (``core.schema.SCHEMA``), the ``serve`` flags
(``settings.FLAGS``, in the configuration reference and in the contracts) and the metrics (the
plugin's real registry).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `deployment.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployment.chart import ROOT
from vgpu_plugin.commands.settings import FLAGS
from vgpu_plugin.core.pods import PodRef
from vgpu_plugin.core.schema import SCHEMA
from vgpu_plugin.node.observe.metrics import PluginMetrics, new_registry
from vgpu_plugin.node.observe.nodeview import AllocationGpuView, AllocationView, GpuView, NodeView

DOCS = ROOT / "docs"
NONE = "—"


def _cell(text: str) -> str:
    """Markdown-safe: pipes escaped, <placeholders> shown rather than read as HTML tags."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def config_table() -> str:
    rows = []
    for spec in SCHEMA:
        kind = spec.type + (", required" if spec.required else "")
        default = f"`{spec.default_text}`" if spec.default_text else NONE
        allowed = spec.allowed or NONE
        rows.append([f"`{spec.path}`", kind, default, allowed, spec.description])
    return _table(("Key", "Type", "Default", "Allowed", "Meaning"), rows)


def flags_table() -> str:
    rows = [
        [f"`--{f.name}`", f"`{f.env}`", f"`{f.default}`" if f.default else NONE, f.help]
        for f in FLAGS
    ]
    return _table(("Flag", "Environment variable", "Default", "Meaning"), rows)


def _sample_view() -> NodeView:
    """A node with one GPU and one allocation, every figure known, so every series shows."""
    gpu = GpuView("GPU-x", 0, "model", 10, 1, 1 << 30, 1 << 20, 1 << 20, 1 << 20, True)
    share = AllocationGpuView("GPU-x", 1 << 20, 0, 10, 1)
    allocation = AllocationView("a", PodRef("ns", "pod", "ctr"), (share,), 1, "ok", 0.0)
    return NodeView((gpu,), (allocation,))


def sample_metrics() -> PluginMetrics:
    """The plugin's registry over ``_sample_view``, every figure known (NVML's utilisation
    too, which this machine may not have), so every series shows."""
    return new_registry(
        _sample_view, hostname="node", utilization=lambda: {"GPU-x": 0.5}, build=("v", "v-id")
    )


def metric_families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(name as exposed, type, labels, help) of every metric the plugin serves."""
    out = []
    for family in sample_metrics().registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        name = family.name + ("_total" if family.type == "counter" else "")
        out.append((name, family.type, tuple(labels), family.documentation))
    return out


def metrics_table() -> str:
    rows = [
        [f"`{name}`", kind, ", ".join(f"`{label}`" for label in labels) or NONE, doc]
        for name, kind, labels, doc in metric_families()
    ]
    return _table(("Metric", "Type", "Labels", "Meaning"), rows)


# --- the quickstart's samples: what `status` and a scrape print for one pod on a slice ------

QS_GPU = "GPU-709fac35-5f40-624b-90f7-b0a3db7a97a0"
QS_MODEL = "NVIDIA A100-SXM4-80GB"
MIB = 1 << 20


def quickstart_view() -> NodeView:
    """One A100 split in 10, one pod (default/cuda-slice/main) on one slice that has run its
    allocation past the limit: the quickstart's step 5."""
    gpu = GpuView(QS_GPU, 0, QS_MODEL, 10, 1, 81920 * MIB, 8192 * MIB, 2100 * MIB, 2650 * MIB, True)
    share = AllocationGpuView(
        QS_GPU,
        8192 * MIB,
        2100 * MIB,
        0,
        1,
        refused=1,
        memory_peak=2100 * MIB,
        driver_limit="requested",
    )
    pod = PodRef("default", "cuda-slice", "main")
    allocation = AllocationView("019a3f2b7c1d5e8f9a0b", pod, (share,), 1, "ok", 0.0)
    return NodeView((gpu,), (allocation,))


def quickstart_status() -> str:
    from vgpu_plugin.commands.status import render_status

    return "```\n" + render_status(quickstart_view()).rstrip("\n") + "\n```"


def quickstart_metrics() -> str:
    from prometheus_client import generate_latest

    registry = new_registry(
        quickstart_view,
        hostname="gpu-node-1",
        utilization=lambda: {QS_GPU: 0.41},
        build=("0.1.0", "0.1.0-67b5e5ba3de6"),
    ).registry
    lines = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if line.startswith(("vgpu_container_memory_", "vgpu_gpu_memory_total"))
    ]
    cmd = "curl -s localhost:9400/metrics | grep -E 'vgpu_container_memory_|vgpu_gpu_memory_total'"
    return "```sh\n" + cmd + "\n" + "\n".join(f"# {x}" for x in lines) + "\n```"


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "quickstart-status": ("quickstart.md", quickstart_status),
    "quickstart-metrics": ("quickstart.md", quickstart_metrics),
    "config-keys": ("configuration.md", config_table),
    "serve-flags": ("configuration.md", flags_table),
    "contract-serve-flags": ("contracts.md", flags_table),
    "metrics": ("metrics.md", metrics_table),
}


def _region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{name} -->\n)(.*?)\n?(<!-- end:{name} -->)", re.S)


def _replacement(table: str) -> Callable[[re.Match[str]], str]:
    return lambda m: m.group(1) + table + "\n" + m.group(3)


def current(name: str) -> str | None:
    """The table now in the document, or None when its markers are missing."""
    doc, _ = TABLES[name]
    m = _region(name).search((DOCS / doc).read_text())
    return m.group(2) if m else None


def stale() -> list[str]:
    return [name for name, (_, make) in TABLES.items() if current(name) != make()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale tables")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"docs/{TABLES[name][0]}: table {name} is out of date", file=sys.stderr)
        return 1 if names else 0
    for name, (doc, make) in TABLES.items():
        path = DOCS / doc
        text = path.read_text()
        pattern = _region(name)
        if not pattern.search(text):
            print(f"docs/{doc}: no <!-- generated:{name} --> markers", file=sys.stderr)
            return 1
        new = pattern.sub(_replacement(make()), text)
        if new != text:
            path.write_text(new)
            print(f"docs/{doc}: wrote table {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
