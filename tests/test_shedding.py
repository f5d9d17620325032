"""Past capacity, refusals follow the tenant weights (scheduling/shedding.py).

The closed loop below stands for a class past capacity: arrivals that are not shed compete for a
fixed capacity in arrival order (what the late refusals do), so without shedding every tenant
gets the same share whatever its weight.
"""

from __future__ import annotations

import math
import random
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from admission.scheduling.overload import REFUSING_S, Overload
from admission.scheduling.shedding import IDLE_S, TAU_S, FairShed, Rate, fair_rate

WEIGHTS = {"acme": 5.0, "globex": 3.0, "hobbyist": 1.0}


LATE_S = 0.5  # a request waiting longer is refused late (late_heads.py's role)
BURST_S = 0.25  # node slots: up to this many seconds' worth start at once


def _run(
    shed: FairShed | None,
    rates: dict[str, float],
    capacity: float,
    seconds: float,
    start: float = 0.0,
    seed: int = 1,
    marked: float = -1e9,
) -> tuple[dict[str, int], dict[str, int], float]:
    """A class on one sidecar: Poisson arrivals at `rates` (requests/s, cost 1); those not shed
    wait in a FIFO for a node that takes `capacity` a second; one waiting over LATE_S is
    refused late, which marks the class past capacity for REFUSING_S, as does a shed while
    arrivals find no free slot (the dispatcher's rule). Returns (admitted, shed) per tenant and the mark."""
    rnd = random.Random(seed)
    over = Overload()  # the arrivals that find no node (its `short`)
    events = []
    for t, r in rates.items():
        now = start
        while True:
            now += rnd.expovariate(r)
            if now >= start + seconds:
                break
            events.append((now, t))
    events.sort()
    admitted = dict.fromkeys(rates, 0)
    refused = dict.fromkeys(rates, 0)
    waiting: deque[tuple[float, str]] = deque()
    free_at = start

    def serve(until: float) -> None:
        nonlocal free_at, marked
        while waiting:
            arrived, t = waiting[0]
            at = max(free_at - BURST_S, arrived)  # GCRA: a node slot frees every 1/capacity
            if at > arrived + LATE_S:  # it would start late: refused late
                if arrived + LATE_S > until:
                    break
                waiting.popleft()
                marked = max(marked, arrived + LATE_S)
                continue
            if at > until:
                break
            waiting.popleft()
            admitted[t] += 1
            if shed is not None:
                shed.admitted("m", "rt", 1, at)
            free_at = max(free_at, at) + 1 / capacity

    for now, t in events:
        serve(now)
        past = now - marked < REFUSING_S and over.short("m", "rt", now)
        if shed is not None and shed.arrive("m", "rt", t, 1, now, WEIGHTS.get, past):
            refused[t] += 1
            marked = now
            continue
        if shed is not None and (waiting or free_at - BURST_S > now):
            over.no_node("m", "rt", now)  # no node slot free on arrival: it waits
        waiting.append((now, t))
    serve(start + seconds)
    return admitted, refused, marked


def _fair(demand: dict[str, float], total: float) -> dict[str, float]:
    """Weighted max-min fair shares of `total` among tenants asking `demand` (same units)."""
    alpha = fair_rate(demand, WEIGHTS, total)
    return {t: min(d, WEIGHTS[t] * alpha) / total for t, d in demand.items()}


def test_past_capacity_served_shares_follow_the_weights_not_arrival_order() -> None:
    rates = {"acme": 30.0, "globex": 30.0, "hobbyist": 30.0}
    plain, _, _ = _run(None, rates, capacity=60, seconds=60)
    total = sum(plain.values())
    assert max(abs(n / total - 1 / 3) for n in plain.values()) < 0.03  # arrival order: a third

    shed = FairShed()
    _, _, marked = _run(shed, rates, capacity=60, seconds=10)  # warm-up: estimates settle
    got, refused, _ = _run(shed, rates, capacity=60, seconds=60, start=10.0, marked=marked)
    total = sum(got.values())
    fair = _fair(rates, total / 60)  # of ~60/s: acme 30, globex 22.5, hobbyist 7.5
    for t in rates:
        assert abs(got[t] / total - fair[t]) <= 0.03, (got, fair)
    assert refused["hobbyist"] > refused["globex"] > refused["acme"]
    assert total >= 0.95 * 60 * 60  # the capacity stays used
    shown = {f["tenant"]: f["share"] for f in shed.snapshot(70.0)}  # the status page
    assert shown["hobbyist"] > 0.5 and shown.get("acme", 0) < 0.1


def test_a_tenant_under_its_share_is_never_refused_early() -> None:
    rates = {"acme": 5.0, "globex": 40.0, "hobbyist": 40.0}  # acme asks for less than 5/9
    shed = FairShed()
    _, _, marked = _run(shed, rates, capacity=50, seconds=10)
    got, refused, _ = _run(shed, rates, capacity=50, seconds=30, start=10.0, marked=marked)
    assert refused["acme"] == 0 and got["acme"] > 0
    assert refused["hobbyist"] > refused["globex"] > 0


def test_within_capacity_nothing_is_refused() -> None:
    shed = FairShed()
    _, refused, _ = _run(shed, {"acme": 10.0, "globex": 10.0, "hobbyist": 10.0}, 60, 30)
    assert sum(refused.values()) == 0
    assert shed.snapshot(30.0) == []  # nothing shown as shed on the status page


def test_when_the_load_falls_below_capacity_shedding_stops() -> None:
    shed = FairShed()
    high = {"acme": 30.0, "globex": 30.0, "hobbyist": 30.0}
    _, during, marked = _run(shed, high, capacity=60, seconds=20)
    assert during["hobbyist"] > 100
    low = {"acme": 10.0, "globex": 10.0, "hobbyist": 10.0}
    _, _, marked = _run(shed, low, capacity=60, seconds=10, start=20.0, marked=marked)
    got, after, _ = _run(shed, low, capacity=60, seconds=20, start=30.0, marked=marked)
    assert sum(after.values()) == 0 and min(got.values()) > 150


def test_one_tenant_alone_is_left_to_the_late_refusals() -> None:
    shed = FairShed()
    got, refused, _ = _run(shed, {"acme": 100.0}, capacity=50, seconds=20)
    assert sum(refused.values()) == 0 and got["acme"] > 0


def test_a_tenant_gone_quiet_is_forgotten() -> None:
    shed = FairShed()
    _, _, marked = _run(shed, {"acme": 30.0, "hobbyist": 30.0}, capacity=30, seconds=10)
    # Only hobbyist asks from now on: alone, it has nobody to be fair to.
    _, refused, _ = _run(
        shed, {"hobbyist": 30.0}, capacity=30, seconds=20, start=10 + IDLE_S, marked=marked
    )
    assert refused["hobbyist"] == 0


@given(
    st.dictionaries(
        st.sampled_from(sorted(WEIGHTS)), st.floats(0.01, 1000), min_size=1, max_size=3
    ),
    st.floats(0.0, 3000),
)
def test_fair_rate_is_water_filling(rates: dict[str, float], capacity: float) -> None:
    alpha = fair_rate(rates, WEIGHTS, capacity)
    if capacity >= sum(rates.values()) * (1 + 1e-9):
        assert alpha == math.inf
        return
    if alpha == math.inf:  # rounding at the edge: every rate just covered
        assert capacity == pytest.approx(sum(rates.values()))
        return
    given_out = sum(min(r, WEIGHTS[t] * alpha) for t, r in rates.items())
    assert given_out == pytest.approx(capacity, rel=1e-6, abs=1e-6)
    # Nobody under its weight's share is cut; the cut ones get exactly their weight's share.
    assert all(alpha >= 0 for _ in rates)


def test_the_rate_estimate_follows_a_steady_stream() -> None:
    r = Rate()
    for i in range(6000):
        r.add(3.0, i * 0.01)  # 300 a second
    assert r.at(60.0) == pytest.approx(300, rel=0.02)
    assert r.at(60.0 + 8 * TAU_S) < 1  # decays when nothing comes
