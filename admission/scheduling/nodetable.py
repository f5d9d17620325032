"""The sidecar's table of node views, refreshed from Redis: agents' states, admin flags, leases.
Sidecars never scrape engines: they read agents' `NodeState`s, drain flags and lease counts in
one bounded pipeline every `REFRESH_S` (refresh_reads.py); an admission examines a bounded few
nodes (candidates.py). State changes are logged: into or out of down/maintenance as warnings.

One job over 350 lines: the node views and the one refresh pipeline that keeps them; what
rides that pipeline (reads, shares, prompt-head placements) is each its own module.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Protocol

from redis.asyncio import RedisCluster

from admission.loop_lag import LoopLag
from admission.metrics import Metrics
from admission.nodes import feed
from admission.nodes.state import Status
from admission.policy import FailureMode, Policy
from admission.scheduling.answer_lengths import AnswerLengths
from admission.scheduling.ask import Ask, Request
from admission.scheduling.candidates import EXAMINE, Candidates, prefix_nodes
from admission.scheduling.gauges import NodeGauges
from admission.scheduling.head_locations import Placements
from admission.scheduling.prefixes import NO_PREFIX, Prefix
from admission.scheduling.pressure import Pressure
from admission.scheduling.refresh_reads import NodeReads
from admission.scheduling.routing import ClusterFacts, eligible, fallbacks, pool_rank
from admission.scheduling.shares import Shares
from admission.scheduling.views import CLOSED, NodeView, fail_over
from admission.store import REDIS_DOWN, PoolBusy, is_down, keys
from admission.store.connection import on_cluster

log = logging.getLogger(__name__)

EJECT_AFTER = 3  # proxied requests that could not reach a node, within EJECT_S
OUT = frozenset({Status.DOWN, Status.MAINTENANCE})  # states whose changes are warnings
EJECT_S = 10.0  # how long it stays out; then its agent's state applies again
SORT_EVERY_S = 0.2  # the candidates' order, re-sorted at most this often (a state moving: now)
_NONE: frozenset[str] = frozenset()  # no pool blocked (a policy without pools)


class Rider(Protocol):
    """A part whose Redis calls ride the node refresh's one pipeline (shares.Shares,
    head_locations.Placements): it queues its commands and takes their replies, errors in
    place, after the node states (a failed reply: it keeps its last figures)."""

    def queue(self, pipe: Any) -> int: ...  # commands queued

    def take(self, replies: list[Any]) -> None: ...


class NodeTable:
    def __init__(
        self,
        redis: Any,
        policy: Callable[[], Policy],
        metrics: Metrics,
        clock: Callable[[], float],
        answered_s: Callable[[], float] = lambda: float("inf"),
    ) -> None:
        self.redis = redis
        self.answered_s = answered_s  # seconds since Redis answered this sidecar's hot path
        self.policy, self.metrics, self.clock = policy, metrics, clock
        self.views: dict[str, NodeView] = {}
        self.pressure = Pressure(policy, metrics, clock)  # memory-aware limits (pressure.py)
        self._last_ok = clock()
        self._kept = False  # views kept past stale_after_s while the hot path is answered (logged)
        self._read_at = float("inf")  # when the last refresh started (never: views as set)
        self._reading: asyncio.Future[None] | None = None
        self._one_read = asyncio.Lock()
        self.lag = LoopLag()  # the limiter's (Dispatcher): a late loop is not an outage
        self.shares = Shares(policy, clock=clock)  # tenant weights across sidecars (shares.py)
        self.reads = NodeReads(lambda: self.policy().watermarks.stale_after_s)
        self.index = Candidates(secrets.token_hex(4))
        self._urgent_nodes: set[str] = set()  # nodes with urgent KV booked, as last seen
        self._sorted_at = -1e9
        self.live: dict[str, int] = {}  # model → nodes open or held, as last seen
        self.gauges = NodeGauges(metrics)
        self.place_moved = False  # a booking or release since the last sort
        self.answers = AnswerLengths(lambda t: self.policy().weight_of(t))  # the decode guard
        # where prompt heads went (routing)
        self.placements = Placements(metrics, clock, lambda: self.views)
        # What rides the refresh's pipeline besides the node reads, in order (Rider).
        self.riders: list[Rider] = [self.shares, self.placements]
        self.prefixes = self.placements.index
        # Nodes in CLOSED, and who is told when they change (the edge's fail-open skips them).
        self.unusable: frozenset[str] = frozenset()
        self.on_unusable: Callable[[frozenset[str]], None] | None = None
        self.set_policy(policy())

    def set_policy(self, policy: Policy) -> None:
        old, self.views = self.views, {}
        for nid, node in policy.nodes.items():
            v = old.get(nid) or NodeView(node)
            v.node = node
            self.views[nid] = v
        self.index.set_views(self.views.values())
        self.reads.full = True  # nodes added: read them all

    def get(self, node: str) -> NodeView | None:
        return self.views.get(node)

    def eligible(
        self,
        req: Request,
        waiting: Callable[[str], int] = lambda _t: 0,
        waiting_kv: Callable[[str], int] = lambda _c: 0,
        owed: bool = False,
        refusing: bool = False,
    ) -> list[tuple[NodeView, Ask]]:
        """Nodes for this request, best first. `waiting(tenant)`: how many of a tenant's
        requests wait in the queue; a pool whose owners wait is not lent. `waiting_kv(class)`:
        KV tokens waiting in the queue that asked for a class (the urgent class's part is kept
        free on the nodes by the other classes). `owed`, `refusing`: the class's overload state
        (overload.py; routing.ClusterFacts)."""
        policy, model, tenant = self.policy(), req.model, req.tenant
        urgent_kv = 0 if policy.is_urgent(req.cls) else self.urgent_waiting(waiting_kv)
        blocked = (
            frozenset(pool for t, pool in policy.tenant_pool.items() if t != tenant and waiting(t))
            if policy.tenant_pool
            else _NONE
        )
        hits = self.prefixes.matches(req.prefix) if req.prefix else None
        present = urgent_kv > 0 or any(
            model in self.views[n].node.models for n in self._urgent_nodes if n in self.views
        )
        facts = ClusterFacts(
            self.clock(),
            blocked,
            urgent_kv,
            self.answers.mean,
            hits,
            present,
            self.live.get(model),  # None: not counted yet (routing counts what it sees)
            refusing,
            owed,
        )
        gate = self.metrics.noes  # this decision's no's: counted by said_no below

        def judge(views: list[NodeView]) -> list[tuple[NodeView, Ask]]:
            return eligible(views, policy, req, facts, gate)

        pools = self.index.pools(model)
        if policy.pools:  # the tenant's own pool first, then shared nodes, then lenders
            ranked = [(self._pool_rank(policy, tenant, model, p, blocked), p) for p in pools]
            pools = [p for r, p in sorted(ranked, key=lambda rp: rp[0] or 0) if r is not None]
        held = prefix_nodes(hits, self.views) if hits else []
        found = self.index.pick(model, pools, held, judge)
        self.metrics.said_no(None if found or not pools else req.cls or "")  # None: it goes
        return found

    def _pool_rank(
        self, policy: Policy, tenant: str | None, model: str, pool: str | None, blocked: Any
    ) -> int | None:
        first = self.index.first(model, pool, 1)
        return pool_rank(policy, tenant, first[0].node, blocked) if first else None

    def cached(self, prefix: Prefix) -> dict[str, int]:
        return self.placements.cached(prefix)

    def prefix_booked(self, ticket: str, view: NodeView, ask: Ask, res: Any) -> None:
        if ask.urgent:
            self._urgent_nodes.add(view.node.id)  # the decode guard acts from now on
        self.placements.booked(ticket, view, ask, res)

    def urgent_waiting(self, waiting_kv: Callable[[str], int]) -> int:
        """KV tokens waiting in the queue that asked for the urgent class (admitted until drain)."""
        policy = self.policy()
        return sum(waiting_kv(n) for n in policy.classes if policy.is_urgent(n))

    def near(self, model: str, prefix: Prefix = NO_PREFIX) -> list[NodeView]:
        """The nodes a first token of `model` comes soonest from, bounded: those holding the
        prompt's head and the least loaded of each pool (candidates.py)."""
        held = prefix_nodes(self.prefixes.matches(prefix), self.views) if prefix else []
        first = [v for p in self.index.pools(model) for v in self.index.first(model, p, EXAMINE)]
        return held + first

    def fallbacks(self, nodes: list[NodeView], model: str, tenant: str) -> list[tuple[str, str]]:
        policy = self.policy()
        return fallbacks(
            nodes,
            self.near(model),
            model,
            lambda n: pool_rank(policy, tenant, n) is not None,
        )

    def serves(self, model: str) -> bool:
        return model in self.index.by_model

    async def fresh(self, max_age_s: float) -> None:
        """Make sure the views are at most `max_age_s` old: an idle dispatcher polls less often,
        and the first decision after a quiet spell reads first (one read shared by all)."""
        if self.clock() - self._read_at <= max_age_s:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self.refresh())
        await asyncio.shield(self._reading)

    async def refresh(self) -> None:
        """Learn what changed about the nodes (refresh_reads.py), and tell and hear placements.
        One at a time (the dispatcher's poll, a decision after a quiet spell, an operator's
        drain): each reads from where the last one ended."""
        async with self._one_read:
            await self._refresh()

    async def _refresh(self) -> None:
        self._read_at = self.clock()
        views = list(self.views.values())
        # Redis's clock (the ledgers' times are its): in the pipeline, or on a Cluster (where a
        # pipeline refuses TIME) asked of one master beside it.
        cluster = isinstance(self.redis, RedisCluster)
        pipe = self.redis.pipeline(transaction=False)
        if not cluster:
            pipe.time()
        plan = self.reads.queue(pipe, views, self._read_at)
        reads = 1 + plan.commands
        spans, at = [], reads  # each rider's replies: res[at : at + its commands]
        for rider in self.riders:
            n = rider.queue(pipe)
            spans.append((rider, at, at + n))
            at += n
        try:
            res = await self._execute(pipe, cluster)
        except REDIS_DOWN as exc:
            self._refresh_failed(exc)
            return
        if bad := [r for r in res[:reads] if isinstance(r, Exception)]:
            self._refresh_failed(bad[0])  # (in place: a Cluster's per-master errors)
            return
        now = self._last_ok = self.clock()
        self._kept = False
        secs, micros = res[0]
        redis_us = int(secs) * 1_000_000 + int(micros)
        dirty = self.reads.apply(plan, res[1:reads], redis_us, now, self.views)
        states_moved = self._observe(dirty, now) or plan.full
        for rider, start, end in spans:  # a failed reply: the rider keeps its last figures
            rider.take(res[start:end])
        self.gauges.set([self.views[n] for n in dirty])
        self.pressure.gauge()
        if self.reads.moved or self.place_moved or states_moved:  # the order moved
            self.index.stale, self.reads.moved, self.place_moved = True, False, False
        if self.index.stale and (states_moved or now - self._sorted_at >= SORT_EVERY_S):
            self.index.sort(now)
            self._sorted_at = now
        if not states_moved:
            return
        self._by_model(now)
        unusable = frozenset(v.node.id for v in views if v.state in CLOSED)
        if unusable != self.unusable:
            self.unusable = unusable
            if self.on_unusable is not None:
                self.on_unusable(unusable)

    async def _execute(self, pipe: Any, cluster: bool) -> list[Any]:
        """Run the refresh pipeline; Redis's clock first. Per-command errors come back in
        place: the feed's writes must not fail the reads (a Redis refusing writes — OOM,
        READONLY — still serves node states). On a Cluster (where a pipeline refuses TIME) the
        clock is asked of one master beside it."""
        if not cluster:
            return list(await pipe.execute(raise_on_error=False))
        node = self.redis.get_default_node()
        clock, res = await asyncio.gather(
            on_cluster(self.redis, lambda: self.redis.time(target_nodes=node)),
            on_cluster(self.redis, lambda: pipe.execute(raise_on_error=False), 0),
        )
        return [clock, *res]

    def _observe(self, dirty: set[str], now: float) -> bool:
        """Apply the states read for the `dirty` nodes; whether any node's state moved (each
        move logged: into or out of down/maintenance as a warning)."""
        wall, moved = time.time(), False
        for nid in dirty:
            v = self.views[nid]
            was = v.state
            v.observe(self.reads.state_of(nid, now), nid in self.reads.admin)
            (self._urgent_nodes.add if v.kv_urgent > 0 else self._urgent_nodes.discard)(nid)
            if v.state != was:
                v.since, moved = wall, True
                level = logging.WARNING if {was, v.state} & OUT else logging.DEBUG  # hold: often
                log.log(level, "node %s: %s → %s%s", nid, was, v.state, self.reads.why(nid, now))
                if v.state == Status.DOWN:
                    self.prefixes.drop_node(nid)  # a restarted engine has an empty cache
        return moved

    def touch(self, node: str) -> None:
        """This sidecar booked on `node` or released there: read its ledger next refresh."""
        self.reads.touch(node)
        self.place_moved = True

    def _by_model(self, now: float) -> None:
        """Per model, when a node's state moved: how many nodes are open or held (routing's
        cluster-wide figure), and whether every live one is held (pressure.py)."""
        held = (Status.HOLD, Status.DRAIN)
        gone = (Status.DOWN, Status.MAINTENANCE)
        for model, views in self.index.by_model.items():
            live = [v for v in views if v.state not in gone]
            self.live[model] = sum(1 for v in live if v.state in (Status.OPEN, Status.HOLD))
            self.metrics.model_nodes.labels(model).set(self.live[model])
            self.pressure.held(model, bool(live) and all(v.state in held for v in live), now)

    def _refresh_failed(self, exc: BaseException | None = None) -> None:
        self.reads.lost = True  # the next read checks the feed still reaches back
        # Our own lateness, a pool with every connection in use, or a connection closed after such
        # a timeout (redis-py's Cluster client does): overload, not an outage. Keep the views.
        if isinstance(exc, REDIS_DOWN) and (self.lag.overloaded() or isinstance(exc, PoolBusy)):
            self.lag.timed_out(self.metrics, "refresh")
            return
        self.metrics.redis_errors.labels("refresh").inc()
        stale_s = self.policy().watermarks.stale_after_s
        if self.clock() - self._last_ok < stale_s:
            return  # keep the last view through a blip
        if self.answered_s() < stale_s:
            self._keep(exc)
            return
        fail_over(self.views.values(), self.policy().redis.failure_mode == FailureMode.OPEN)
        self.index.stale = True

    def _keep(self, exc: BaseException | None) -> None:
        """The reads fail past stale_after_s, but Redis answers this sidecar's leases and debits:
        not an outage (a Redis slow on the reads' larger pipeline, seen under 8 sidecars on a
        loaded 2-core Cluster). The last views are kept, and the ledgers still bound every node;
        `admission_node_views_age_seconds` grows (alerted past 5 s). Logged once an episode."""
        if self._kept:
            return
        self._kept = True
        log.warning(
            "node views not read for %.1f s (%s), but Redis answers leases: last views kept",
            self.clock() - self._last_ok,
            type(exc).__name__ if exc is not None else "no answer",
        )

    async def proxied(self, node: str, failed: bool, ticket: str) -> None:
        """A release said the edge could not reach the node: `EJECT_AFTER` such requests within
        `EJECT_S`, counted in Redis across every sidecar, take it out of rotation everywhere for
        `EJECT_S`; then its agent's state applies again (a healthy node is back, a dead one is
        down by its failed health checks). Counted by ticket, so an edge re-sending a batch
        counts nothing twice. Successes cost nothing: nothing is written. Redis refusing
        (down, READONLY, OOM): not counted, and the release goes on."""
        if not failed or node not in self.views:
            return
        fails_key = keys.node_fails(node)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.sadd(fails_key, ticket)
            pipe.pexpire(fails_key, int(EJECT_S * 1000), nx=True)
            pipe.scard(fails_key)
            count = int((await pipe.execute())[2])
            if count < EJECT_AFTER:
                return
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(keys.node_eject(node), "1", px=int(EJECT_S * 1000))
            pipe.delete(fails_key)
            feed.add(pipe, node, "e", str(int(EJECT_S * 1000)))  # every sidecar, next refresh
            await pipe.execute()
        except Exception as exc:
            if not is_down(exc):
                raise
            return
        self.views[node].state = Status.DOWN
        self.reads.ejected_until[node] = self.clock() + EJECT_S
        self.index.stale = True
        self.metrics.node_ejections.labels(node).inc()
        msg = "node %s: %d proxied requests failed to reach it within %ss; out of rotation for %ss"
        log.warning(msg, node, EJECT_AFTER, EJECT_S, EJECT_S)

    async def set_maintenance(self, node: str, on: bool) -> None:
        pipe = self.redis.pipeline(transaction=False)
        if on:
            pipe.set(keys.node_admin(node), "drain")
        else:
            pipe.delete(keys.node_admin(node))
        feed.add(pipe, node, "a", "drain" if on else "")  # every sidecar, with its next refresh
        await pipe.execute()
        await self.refresh()

    def views_age(self) -> float:
        """Seconds since the views were last read from Redis in full (a refresh that ended well)."""
        return max(0.0, self.clock() - self._last_ok)

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [v.snapshot(now) for v in self.views.values()]
