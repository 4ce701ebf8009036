"""The quickstart explains every column of the status table the demo prints (the sample there is
rendered by the code,
tests/deployment/generate_docs.py), and the demo's "on target" band is
the one it documents."""

from __future__ import annotations

import re
from typing import Any

import pytest

from deployment.generate_docs import DOCS, TABLES
from deployment.test_docs import rows
from vgpu_plugin.sim import cap_share, demo

QUICKSTART = DOCS / "quickstart.md"


def _printed_columns() -> list[str]:
    """Column headers of the status sample as the code renders it now (render_status)."""
    sample = TABLES["quickstart-status"][1]()
    headers = [
        line
        for line in sample.splitlines()
        if line.startswith("  IDX") or line.startswith("  NAME")
    ]
    assert len(headers) == 2, "the sample shows both tables"
    return [c for h in headers for c in re.split(r" {2,}", h.strip())]


def _documented_columns() -> dict[str, str]:
    text = QUICKSTART.read_text()
    table = text.split("Every column (the demo prints the same table):", 1)[1].split("\n\n", 2)[1]
    return {r[0].strip("`"): r[1] for r in rows(table)}


def test_every_column_the_demo_prints_is_explained() -> None:
    printed, documented = _printed_columns(), _documented_columns()
    assert len(printed) == 22
    assert [c for c in printed if c not in documented] == []
    assert [c for c in documented if c not in printed] == [], "a column the table lacks"


class _Admitted:
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def compute_limit(self) -> int:
        return self.limit


@pytest.mark.parametrize(("share", "judged"), [(55.0, "on target"), (45.0, "on target"),
                                               (55.5, "OFF"), (44.4, "OFF")])  # fmt: skip
def test_on_target_is_the_documented_five_points(share: float, judged: str) -> None:
    doc = " ".join(QUICKSTART.read_text().split())
    assert "**on target** when within 5 percentage points" in doc
    admitted: Any = _Admitted(50)
    step = cap_share.RESOLUTION_NS
    steps = [round(share / 100 * step)] * 400  # 2 s of simgpu's record at that share
    record = cap_share.measure(steps, step, 50, 10 * cap_share.MS)
    pod = demo.Pod("batch", 1, ["compute"], "", admitted=admitted, share=record)
    assert judged in demo.verdict(pod)
