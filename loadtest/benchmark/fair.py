"""Tenants' realtime shares in a benchmark run, against their weights: weighted max-min fair
shares, over the run and window by window."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.benchmark.records import Record


def fair_shares(
    served: float, demand: dict[str, float], weights: dict[str, float]
) -> dict[str, float]:
    """Weighted max-min fair shares of `served` tokens: each tenant gets what it asked for
    (`demand`) or its weight's part of what is left, whichever is less (water-filling). A tenant
    that asked for less than its weight's share is owed only what it asked: its weight is not a
    claim on work it never sent, and the rest goes to the others by their weights."""
    out = {t: 0.0 for t in weights}
    left, wleft = served, sum(w for t, w in weights.items() if demand.get(t, 0.0) > 0)
    for t in sorted(
        (t for t in weights if demand.get(t, 0.0) > 0), key=lambda t: demand[t] / weights[t]
    ):
        take = min(demand[t], left * weights[t] / wleft) if wleft > 0 else 0.0
        out[t], left, wleft = take, left - take, wleft - weights[t]
    return {t: (v / served if served else math.nan) for t, v in out.items()}


FAIR_WINDOW_S = 10.0  # the per-window fair share: requests grouped by when they were sent


def windowed_fair(records: list[Record], weights: dict[str, float]) -> dict[str, float]:
    """Each tenant's weighted max-min fair share per window (`FAIR_WINDOW_S`, by send time),
    weighted by the realtime tokens served in each. The whole-run figure counts capacity used
    before any backlog formed as if later requests could have had it (docs/benchmarks.md)."""
    served: dict[int, Counter[str]] = defaultdict(Counter)
    demand: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        if r.cls != "realtime":
            continue
        w = int(r.sent_s // FAIR_WINDOW_S)
        if r.ok:
            served[w][r.tenant] += r.completion_tokens
        demand[w][r.tenant] += r.completion_tokens if r.ok else r.asked_tokens
    owed: dict[str, float] = defaultdict(float)
    for w, got in served.items():
        total = sum(got[t] for t in weights)
        if total:
            for t, f in fair_shares(total, demand[w], weights).items():
                owed[t] += f * total
    whole = sum(owed.values())
    return {t: (owed[t] / whole if whole else math.nan) for t in weights}


def shares(served: dict[str, float], weights: dict[str, float]) -> dict[str, tuple[float, float]]:
    """tenant → (share of served tokens, share by weight), over the tenants in `weights`."""
    total = sum(served.get(t, 0.0) for t in weights)
    wsum = sum(weights.values())
    return {
        t: ((served.get(t, 0.0) / total) if total else math.nan, w / wsum)
        for t, w in weights.items()
    }
