"""Past capacity, the refusals follow the tenant weights. Pure: time is passed in.

While a class is being refused late (`on_late: refuse`: past what any order serves), the queue
stays short and empties often — whoever waits when a node frees goes, whoever waits when none
does is refused: by arrival, not by weight (docs/benchmarks.md: served 38 / 34 / 28 % against
weighted max-min fair shares 47 / 40 / 13 % on the support mix at 2.0×). Weighted fair queuing
orders only what waits; past capacity the weights bind only if the refusals follow them.

So, as core-stateless fair queuing drops packets (Stoica, Shenker, Zhang 1998), each sidecar
estimates per (model, class) every tenant's arrival rate r_i and the class's admitted rate C (the
capacity it really gets, as this sidecar sees it: the edge spreads requests over the sidecars,
so both are the same fraction of the cluster's), finds the fair rate α by water-filling —
Σ min(r_i, w_i·α) = C·(1 + SLACK) — and refuses at arrival, early, the part 1 − w_i·α / r_i of a
tenant's requests above its weight's share (429 `over_fair_share`, Retry-After). A tenant at or
under its share is never refused here. SLACK lets a little more than the capacity through, so
the late refusals (in arrival order) go on at a low rate: they are the signal that the class is
still past capacity; when the load falls below it, α grows past every tenant's rate and nothing
is refused. One tenant alone has nobody to be fair to: left to the late refusals.
Rates in cost units (prompt + output cap, as the queue charges), so large requests weigh more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

TAU_S = 5.0  # averaging time of the rate estimates (CSFQ's K)
SLACK = 0.05  # a cut tenant gets this much above its share: the capacity estimate can grow
IDLE_S = 4 * TAU_S  # a tenant not seen this long is forgotten
SHOWN_S = 5.0  # the status page shows a tenant's share refused this long after its last arrival


@dataclass
class Rate:
    """An exponentially averaged rate of cost per second (CSFQ's estimator: each arrival of
    size l after a gap T moves it by (1 − e^(−T/τ))·l/T, so bursts and gaps average out)."""

    value: float = 0.0
    last: float = -math.inf

    def add(self, cost: float, now: float) -> None:
        gap = now - self.last
        if gap == math.inf:
            self.value, self.last = cost / TAU_S, now
            return
        gap = max(gap, 1e-6)
        decay = math.exp(-gap / TAU_S)
        self.value = (1 - decay) * cost / gap + decay * self.value
        self.last = max(self.last, now)

    def at(self, now: float) -> float:
        """The rate as of `now`: decayed over the time since the last event."""
        return self.value * math.exp(-max(0.0, now - self.last) / TAU_S)


def fair_rate(rates: dict[str, float], weights: dict[str, float], capacity: float) -> float:
    """α with Σ min(r_i, w_i·α) = capacity (weighted max-min fair, water-filling); inf when
    the capacity covers every rate."""
    left, weight = capacity, sum(weights[t] for t in rates)
    for t in sorted(rates, key=lambda t: rates[t] / weights[t]):
        if weight <= 0:
            break
        alpha = left / weight
        if rates[t] > weights[t] * alpha:
            return max(0.0, alpha)
        left -= rates[t]
        weight -= weights[t]
    return math.inf


class FairShed:
    """Which arrivals to refuse early, per (model, class), while the class is past capacity
    (`past_capacity`: overload.py's SHEDDING)."""

    def __init__(self) -> None:
        self._arrived: dict[tuple[str, str], dict[str, Rate]] = {}
        self._admitted: dict[tuple[str, str], Rate] = {}
        self._debt: dict[tuple[str, str, str], float] = {}
        self._shown: dict[
            tuple[str, str], tuple[float, float]
        ] = {}  # (class, tenant) → (share, at)

    def admitted(self, model: str, cls: str, cost: float, now: float) -> None:
        """A request of the class sent to a node (by any path)."""
        self._admitted.setdefault((model, cls), Rate()).add(cost, now)

    def models(self) -> set[str]:
        """The models something was admitted for."""
        return {m for m, _c in self._admitted}

    def class_share(self, model: str, cls: str, now: float) -> float:
        """`cls`'s part of the tokens admitted for `model` (all classes), averaged over TAU_S;
        1.0 when nothing was admitted."""
        rates = {c: r.at(now) for (m, c), r in self._admitted.items() if m == model}
        total = sum(rates.values())
        return rates.get(cls, 0.0) / total if total > 0 else 1.0

    def arrive(
        self,
        model: str,
        cls: str,
        tenant: str,
        cost: float,
        now: float,
        weight: Callable[[str], float],
        past_capacity: bool,
    ) -> bool:
        """Count an arrival; True if it is to be refused early: the class is `past_capacity`
        (being refused late) and this tenant asks more than its weight's share. Refusals are
        spread evenly: each arrival adds its share to the tenant's debt, one is refused per
        whole unit (no randomness: the same arrivals give the same answers)."""
        tenants = self._arrived.setdefault((model, cls), {})
        tenants.setdefault(tenant, Rate()).add(cost, now)
        key = (model, cls, tenant)
        if not past_capacity or len(tenants) < 2:
            self._debt.pop(key, None)
            self._shown.pop((cls, tenant), None)
            return False
        p = self.share(model, cls, tenant, now, weight)
        self._shown[(cls, tenant)] = (p, now)
        debt = self._debt.get(key, 0.0) + p
        refuse = debt >= 1.0
        self._debt[key] = debt - 1.0 if refuse else debt
        return refuse

    def share(
        self, model: str, cls: str, tenant: str, now: float, weight: Callable[[str], float]
    ) -> float:
        """The part of `tenant`'s arrivals above its weight's share of the capacity (0–1)."""
        tenants = self._arrived.get((model, cls), {})
        for t in [t for t, r in tenants.items() if now - r.last > IDLE_S]:
            del tenants[t]
        rates = {t: r.at(now) for t, r in tenants.items()}
        mine = rates.get(tenant, 0.0)
        if mine <= 0 or len(rates) < 2:
            return 0.0
        admitted = self._admitted.get((model, cls))
        capacity = admitted.at(now) if admitted else 0.0
        weights = {t: max(1e-9, weight(t)) for t in rates}
        alpha = fair_rate(rates, weights, capacity)
        if alpha == math.inf:
            return 0.0
        return max(0.0, 1.0 - (1 + SLACK) * weights[tenant] * alpha / mine)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        """For the status page: per (class, tenant) refused early now, the share refused."""
        for k in [k for k, (_p, at) in self._shown.items() if now - at > SHOWN_S]:
            del self._shown[k]
        return [
            {"class": c, "tenant": t, "share": round(p, 3)}
            for (c, t), (p, _at) in sorted(self._shown.items())
            if p > 0
        ]
