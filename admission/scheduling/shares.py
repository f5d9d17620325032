"""Tenant weights across sidecars: who goes next when tenants wait on different sidecars.

Each sidecar's FairQueue orders its own waiting requests by tenant weight. Node slots are shared
in Redis and taken first come, first served, so two tenants whose traffic reaches different
sidecars (regional edges, sticky load balancers) would share the nodes by who asks first. Here
every sidecar keeps, per model and class, each tenant's *normalised service* — tokens admitted ÷
the tenant's weight, summed over every sidecar — and which tenants wait somewhere, in one Redis
hash per (model, class), written and read with the node refresh (no round trip of its own, none
on the admission path).

A sidecar holds a request back while a tenant waiting on another sidecar has been served less
(normalised) than this one's tenant by more than `SLACK_REQUESTS` of its requests: the other
sidecar takes the next freed slot — only while that tenant is blocked (its oldest request has
waited `BLOCKED_S`: the nodes are full; with room, nobody is held). Only for tenants whose traffic does not
reach this sidecar (none admitted or waiting here for `LOCAL_S`): one that asks here too is
ordered by this sidecar's own queue already, and holding for it only delays realtime. Held back at most `HOLD_MAX_S` (a tenant waiting elsewhere
that cannot use the nodes — its own gates — does not idle them). A tenant that starts waiting
after an idle spell starts at the least service among those waiting (it banks no credit while
idle), as the queue's own lanes do, and no waiting tenant is owed more than `CREDIT_REQUESTS`
of its requests (one its own rate limit keeps behind would otherwise stall everyone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from admission.policy import Policy
from admission.store import keys

SLACK_REQUESTS = 2.0  # how far ahead (in this request's normalised cost) a tenant may run
ROOM_PER_OWED = 2  # nodes with room per tenant owed, above which nobody is held back
CREDIT_REQUESTS = 8.0  # a waiting tenant is owed at most this many of its requests
DEFAULT_COST = 1000  # a tenant's request cost (tokens) before one was seen here
HOLD_MAX_S = 1.0  # a request is held back for fairness at most this long
FRESH_S = 0.5  # "waiting" marks older than this are stale (5 refreshes: its sidecar is gone)
BLOCKED_S = 0.2  # a tenant waiting elsewhere counts once its oldest request waited this long:
# the nodes are full for it (a request waiting less is only between two dispatcher passes)
LOCAL_S = 2.0  # a tenant admitted or waiting here this recently is ordered by this sidecar's own
# queue: not held for (support mix, 2 sidecars, every tenant on both: holding for tenants
# momentarily waiting only on the other cost realtime 20 points of TTFT attainment)


@dataclass
class _Pair:
    served: dict[str, float] = field(default_factory=dict)  # tenant → normalised service
    # tenant → (when last marked waiting, epoch s; how long its oldest request had waited, s)
    waiting: dict[str, tuple[float, float]] = field(default_factory=dict)
    delta: dict[str, float] = field(default_factory=dict)  # this sidecar's, not yet written
    cost: dict[str, int] = field(default_factory=dict)  # tenant → its last request's cost
    here: dict[str, float] = field(default_factory=dict)  # tenant → last admitted/waiting here


class Shares:
    def __init__(
        self,
        policy: Callable[[], Policy],
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.wall, self.clock = wall, clock
        # This sidecar's waiting tenants per (model, class): tenant → when its oldest waiting
        # request arrived, on `clock` (the dispatcher's queue: FairQueue.waiting_tenants).
        self.waiting: Callable[[], dict[tuple[str, str], dict[str, float]]] = dict
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._reads: list[tuple[tuple[str, str], int]] = []  # pair, index of its HGETALL

    def _weight(self, tenant: str) -> float:
        return self.policy().weight_of(tenant)

    def served(self, model: str, cls: str, tenant: str, cost: int) -> None:
        """This sidecar admitted `cost` tokens for `tenant`."""
        p = self._pairs.setdefault((model, cls), _Pair())
        n = max(1, cost) / self._weight(tenant)
        p.cost[tenant] = max(1, cost)
        p.here[tenant] = self.wall()
        p.delta[tenant] = p.delta.get(tenant, 0.0) + n
        p.served[tenant] = p.served.get(tenant, 0.0) + n

    def may_take(
        self,
        model: str,
        cls: str,
        tenant: str,
        cost: int,
        held_s: float,
        mine: Collection[str],
        room: int,
    ) -> bool:
        """Whether `tenant`'s request may take a node now: no tenant waiting on another sidecar
        (not in `mine`, this sidecar's waiting tenants) is behind it by more than the slack.
        `held_s`: how long this request has been held back already; `room`: how many nodes
        would take it now (routing's bounded pick) — with more than `ROOM_PER_OWED` per tenant
        owed, nodes are not scarce and nobody is held."""
        p = self._pairs.get((model, cls))
        if p is None or held_s >= HOLD_MAX_S:
            return True
        now = self.wall()
        least, owed = 0.0, 0  # blocked elsewhere: waiting there long enough that nodes are full
        for t, (at, waited) in p.waiting.items():
            if (
                t != tenant
                and t not in mine
                and now - at < FRESH_S
                and waited >= BLOCKED_S
                and now - p.here.get(t, -LOCAL_S) >= LOCAL_S
            ):
                served = p.served.get(t, 0.0)
                least = served if owed == 0 else min(least, served)
                owed += 1
        if owed == 0 or room > ROOM_PER_OWED * owed:
            return True
        slack = SLACK_REQUESTS * max(1, cost) / self._weight(tenant)
        return p.served.get(tenant, 0.0) <= least + slack

    def queue(self, pipe: Any) -> int:
        """A refresh rider (nodetable.Rider): queue this sidecar's service since the last
        refresh, its waiting tenants, then a read of every pair either touches; return how many
        commands (their replies go to `take`, in order)."""
        waiting, now = self.waiting(), self.clock()
        now_ms = str(int(self.wall() * 1000))
        pairs = sorted(set(waiting) | {k for k, p in self._pairs.items() if p.delta})
        self._reads = []
        n = 0
        for model, cls in pairs:
            key = keys.tenant_shares(model, cls)
            p = self._pairs.setdefault((model, cls), _Pair())
            lift = self._floor(p, set(waiting.get((model, cls), ())))
            for tenant in set(p.delta) | set(lift):  # service, and a return from idle lifted
                n_ = p.delta.get(tenant, 0.0) + lift.get(tenant, 0.0)
                pipe.hincrbyfloat(key, f"s:{tenant}", n_)
                n += 1
            p.delta = {}
            for tenant, since in waiting.get((model, cls), {}).items():
                p.here[tenant] = self.wall()
                waited_ms = int(max(0.0, now - since) * 1000)
                pipe.hset(key, f"w:{tenant}", f"{now_ms}:{waited_ms}")
                n += 1
            pipe.hgetall(key)
            self._reads.append(((model, cls), n))
            pipe.pexpire(key, 86_400_000)  # a model or class gone from the policy: cleaned up
            n += 2
        return n

    def take(self, replies: list[Any]) -> None:
        """Take the replies to `queue`'s commands (a failed read leaves the last figures)."""
        for pair, i in self._reads:
            got = replies[i] if i < len(replies) else None
            if not isinstance(got, dict):
                continue
            served, waiting = {}, {}
            for k, v in got.items():
                name = k.decode() if isinstance(k, bytes) else k
                if name.startswith("s:"):
                    served[name[2:]] = float(v)
                elif name.startswith("w:"):
                    at, _, waited = (v.decode() if isinstance(v, bytes) else v).partition(":")
                    waiting[name[2:]] = (int(at) / 1000, int(waited or 0) / 1000)
            p = self._pairs[pair]  # Redis's sums, and what this sidecar admitted since it asked
            for t, n in p.delta.items():
                served[t] = served.get(t, 0.0) + n
            p.served, p.waiting = served, waiting
        self._reads = []

    def _floor(self, p: _Pair, mine: set[str]) -> dict[str, float]:
        """How much to lift the service of each of `mine` (waiting here): one that starts
        waiting (not marked lately) to the least among the tenants already waiting — no credit
        banked while idle —, and none below the most served waiting tenant less
        `CREDIT_REQUESTS` of its own requests — no credit banked while its own limits, not the
        nodes, held it back (a rate-limited tenant would otherwise be owed without end)."""
        now = self.wall()
        fresh = {t: p.served.get(t, 0.0) for t, (at, _w) in p.waiting.items() if now - at < FRESH_S}
        everyone = [p.served.get(t, 0.0) for t in (set(fresh) | mine)]
        if not everyone:
            return {}
        low, high = min(fresh.values(), default=0.0), max(everyone)
        out = {}
        for t in mine:
            have = p.served.get(t, 0.0)
            floor = high - CREDIT_REQUESTS * p.cost.get(t, DEFAULT_COST) / self._weight(t)
            if fresh and t not in fresh:
                floor = max(floor, low)
            if have < floor:
                out[t] = floor - have
                p.served[t] = floor
        return out
