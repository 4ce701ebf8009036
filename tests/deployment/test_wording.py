"""In the docs "slice" means one thing, a device-plugin fraction of a GPU; the DRA object is
always written "ResourceSlice" (issue 21, item 6). The phrases below are the ways a bare
"slice" crept in for the API object."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deployment.chart import ROOT

DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "deploy" / "README.md"]
CHART = [*sorted((ROOT / "deploy" / "helm" / "vgpu-plugin").rglob("*.yaml"))]

# A bare "slice" next to what only a ResourceSlice has: an owner, a publisher, a stored copy,
# a driver or a node owning it, device taints, API verbs.
RESOURCE_SLICE_SENSE = re.compile(
    r"(?<![A-Za-z])(?:node's|driver's|stale|stored|published|the node's) slices?\b"
    r"|\bslices? (?:is|are) (?:published|republished|deleted|stored)"
    r"|\b(?:publish|publishes|republish|republishes|deletes|stores) the slices?\b"
    r"|\bthe slice of (?:\"?this node|the node)",
    re.IGNORECASE,
)


@pytest.mark.parametrize("path", DOCS + CHART, ids=lambda p: str(Path(p).relative_to(ROOT)))
def test_a_resource_slice_is_never_called_a_slice(path: Path) -> None:
    text = " ".join(path.read_text().split())
    found = [m.group(0) for m in RESOURCE_SLICE_SENSE.finditer(text)]
    assert found == [], f"{path.relative_to(ROOT)}: write ResourceSlice for {found}"


def test_the_check_sees_the_old_wording() -> None:
    for old in ("the garbage collector deletes the slice with a deleted node",
                "which this driver's slice requires", "a bug, a stale slice",
                "RBAC cannot name \"this node's slice\"", "stores the slice without the taint",
                "the slice of \"this node\""):  # fmt: skip
        assert RESOURCE_SLICE_SENSE.search(old), old
    for fine in ("N equal slices", "the slice's memory", "one slice's size",
                 "its slices are withdrawn", "GPU 0 and 4 slices of GPU 1"):  # fmt: skip
        assert not RESOURCE_SLICE_SENSE.search(fine), fine
