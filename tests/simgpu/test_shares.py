"""The compute tests' measure (tests/simgpu_shares.py) on records of work written by hand: what
`waited_split` counts and leaves out, against `busy_split` over the same record."""

from __future__ import annotations

import pytest
from simgpu_shares import MS, busy_split, waited_split

from vgpu_plugin.sim.simgpu import Span

NB, TENANT = 101, 202


class Record:
    """A GPU's record of work as Node gives it (busy, spans), from spans written here."""

    def __init__(self, spans: list[Span]) -> None:
        self._spans = spans

    def recorded_since(self, index: int) -> int:
        return 0

    def busy(self, index: int, from_ns: int, to_ns: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self._spans:
            got = min(s.end_ns, to_ns) - max(s.start_ns, from_ns)
            if got > 0:
                out[s.pid] = out.get(s.pid, 0) + got
        return out

    def spans(self, index: int, from_ns: int, to_ns: int) -> list[Span]:
        return [s for s in self._spans if s.end_ns > from_ns and s.queued_ns < to_ns]


def contended(until: int, tenant_ms: int, starve: bool = False) -> list[Span]:
    """A neighbour that queues its next 3 ms kernel as its last one ends, and the tenant's
    `tenant_ms` kernel, queued meanwhile, run before it. With `starve`, in 40 ms of every 250
    the host does not run the neighbour and the tenant's 10 ms kernels run alone (lent time);
    the neighbour asks again 8 ms before the last of them ends, and waits for it."""
    out, t, queued = [], 0, 0
    while t < until:
        if starve and 120 * MS <= t % (250 * MS) < 160 * MS:
            out.append(Span(TENANT, t, t, t + 10 * MS))
            t += 10 * MS
            queued = t - 8 * MS
            continue
        out.append(Span(NB, queued, t, t + 3 * MS))
        out.append(Span(TENANT, t + MS, t + 3 * MS, t + (3 + tenant_ms) * MS))
        queued = t + 3 * MS
        t += (3 + tenant_ms) * MS
    return out


def test_the_share_of_the_time_asked_for_leaves_out_what_a_starved_launcher_lent() -> None:
    # 3 ms of the neighbour's, 1 ms of the tenant's: 75 / 25 while both ask
    even = Record(contended(2000 * MS, 1))
    assert waited_split(even, [NB, TENANT], 0, 2000 * MS) == pytest.approx([75, 25], abs=0.5)
    starved = Record(contended(2000 * MS, 1, starve=True))
    _, (nb, _) = busy_split(starved, [NB, TENANT], 0, 2000 * MS)
    assert nb < 70, nb  # counted over whole steps, the lent time is the neighbour's loss
    got = waited_split(starved, [NB, TENANT], 0, 2000 * MS)
    assert got == pytest.approx([75, 25], abs=0.5)


def test_a_tenant_that_takes_the_time_asked_for_is_counted() -> None:
    # the tenant's 9 ms behind each 3 ms of the neighbour's: it has 75 % of the time asked for
    greedy = Record(contended(2000 * MS, 9))
    assert waited_split(greedy, [NB, TENANT], 0, 2000 * MS) == pytest.approx([25, 75], abs=0.5)


def test_too_little_time_asked_for_is_refused() -> None:
    record = Record(contended(300 * MS, 1))
    with pytest.raises(AssertionError):
        waited_split(record, [NB, TENANT], 0, 300 * MS, least=1000 * MS)
