"""The sidecar's table of node views, refreshed from Redis: agents' states, admin flags, leases.

Sidecars never scrape engines: each reads the `NodeState` its node's agent published, the
operator's drain flag and the node's lease count, in one pipeline every `REFRESH_S`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from admission.metrics import Metrics
from admission.nodes.state import NodeState, Status
from admission.policy import FailureMode, Policy
from admission.scheduling import leases
from admission.scheduling.leases import Ask
from admission.scheduling.outputs import UrgentOutputs
from admission.scheduling.prefixes import NO_PREFIX, Prefix, PrefixIndex, pool_blocks
from admission.scheduling.routing import eligible, fallbacks, pool_rank, urgent
from admission.scheduling.views import RESERVE_HALF_S, NodeView
from admission.store import REDIS_DOWN, is_down, keys

log = logging.getLogger(__name__)

EJECT_AFTER = 3  # proxied requests that could not reach a node, within EJECT_S
EJECT_S = 10.0  # how long it stays out; then its agent's state applies again
PREDICTED_KEPT = 50_000  # tickets whose booked-as-cached tokens wait for their release here
FEED_BATCH = 4096  # placements a sidecar tells per refresh at most (more: not told)
FEED_LEN = 20_000  # placements the feed keeps (trimmed approximately): ~1 s at 20k admissions/s
FEED_READ = 20_000  # placements read per refresh at most
_NONE: frozenset[str] = frozenset()  # no pool blocked (a policy without pools)


class NodeTable:
    def __init__(
        self, redis: Any, policy: Callable[[], Policy], metrics: Metrics, clock: Callable[[], float]
    ) -> None:
        self.redis = redis
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.views: dict[str, NodeView] = {}
        self.held_since: dict[str, float] = {}  # model → since when every live node is held
        self._last_ok = clock()
        self._read_at = float("inf")  # when the last refresh started (never: views as set)
        self._reading: asyncio.Future[None] | None = None
        self._bad_state_logged: set[str] = set()
        self.outputs = UrgentOutputs()  # the urgent class's answer lengths: the decode guard
        self.prefixes = PrefixIndex()  # where this sidecar saw prompt heads go (routing)
        self._predicted: OrderedDict[str, int] = OrderedDict()  # ticket → tokens booked cached
        # Placements told to the other sidecars with the next refresh, and the feed's last id
        # read ("0-0": a new sidecar first learns what the stream still holds).
        self._me = secrets.token_hex(4)
        self._outbox: list[tuple[str, Prefix]] = []
        self._feed_id: bytes | str = "0-0"
        # Nodes that take nothing new (down, draining, in maintenance), and who is told when
        # that set changes (the edge's table: its fail-open mode must not pick them).
        self.unusable: frozenset[str] = frozenset()
        self.on_unusable: Callable[[frozenset[str]], None] | None = None
        self.set_policy(policy())

    def set_policy(self, policy: Policy) -> None:
        old, self.views = self.views, {}
        for nid, node in policy.nodes.items():
            v = old.get(nid) or NodeView(node)
            v.node = node
            self.views[nid] = v

    def get(self, node: str) -> NodeView | None:
        return self.views.get(node)

    def eligible(
        self,
        model: str,
        cls: str | None,
        prompt: int,
        kv: int,
        tenant: str | None = None,
        waiting: Callable[[str], int] = lambda _t: 0,
        waiting_kv: Callable[[str], int] = lambda _c: 0,
        prefix: Prefix = NO_PREFIX,
    ) -> list[tuple[NodeView, Ask]]:
        """Nodes for this request, best first. `waiting(tenant)`: how many of a tenant's requests
        wait in the queue; a pool whose owners wait is not lent (they take it back).
        `waiting_kv(class)`: KV tokens waiting in the queue that asked for a class (the urgent
        class's part is kept free on the nodes by the other classes)."""
        policy = self.policy()
        urgent_kv = 0 if urgent(policy, cls) else self.urgent_waiting(waiting_kv)
        blocked = (
            frozenset(pool for t, pool in policy.tenant_pool.items() if t != tenant and waiting(t))
            if policy.tenant_pool
            else _NONE
        )
        hits = self.prefixes.matches(prefix) if prefix else None
        return eligible(
            list(self.views.values()),
            policy,
            model,
            cls,
            prompt,
            kv,
            self.clock(),
            tenant,
            blocked,
            urgent_kv,
            self.metrics.gate,
            self.outputs.mean,
            prefix,
            hits,
        )

    def cached(self, prefix: Prefix) -> dict[str, int]:
        """Node → prompt tokens of `prefix` this sidecar expects its prefix cache to hold."""
        return (
            {n: prefix.tokens(b) for n, b in self.prefixes.matches(prefix).items()}
            if prefix
            else {}
        )

    def prefix_booked(self, ticket: str, view: NodeView, ask: Ask, res: Any) -> None:
        """A lease with a prefix was taken on `view`: its blocks are there now (the engine
        computes them); remember what was booked as cached, to compare with the engine's count."""
        prefix = ask.prefix
        if not prefix:
            return
        hit = leases.hit_blocks(res)
        predicted = ask.hit_tokens if hit is None else prefix.tokens(hit)
        self._predicted[ticket] = min(ask.prompt_tokens, predicted)
        if len(self._predicted) > PREDICTED_KEPT:  # released elsewhere, or lost: oldest out
            self._predicted.popitem(last=False)
        # Told to the other sidecars only when it is news here: a head already placed on this
        # node (the common case, once affinity holds) costs the feed nothing.
        news = self.prefixes.learn(view.node.id, prefix, self.clock(), ask.pool_blocks)
        if news and len(self._outbox) < FEED_BATCH:
            self._outbox.append((view.node.id, prefix))

    def engine_cached(self, ticket: str, cached: int) -> None:
        """The engine's `cached_tokens` for a released ticket (-1: not reported)."""
        predicted = self._predicted.pop(ticket, None)
        if cached >= 0 and predicted is not None:
            self.metrics.prefix_predicted.inc(predicted)
            self.metrics.prefix_engine_cached.inc(cached)

    def prefix_snapshot(self) -> dict[str, Any]:
        """Prompt tokens booked as already computed vs what the engines found cached, over the
        releases that reported it (None: none yet), for the status page."""
        get = self.metrics.registry.get_sample_value
        booked = get("admission_prefix_predicted_tokens_total") or 0.0
        found = get("admission_prefix_engine_cached_tokens_total") or 0.0
        reported = booked > 0 or found > 0
        return {
            "booked_cached_tokens": int(booked) if reported else None,
            "engine_cached_tokens": int(found) if reported else None,
        }

    def urgent_waiting(self, waiting_kv: Callable[[str], int]) -> int:
        """KV tokens waiting in the queue that asked for the urgent class (admitted until drain)."""
        policy = self.policy()
        return sum(waiting_kv(n) for n in policy.classes if urgent(policy, n))

    def fallbacks(self, nodes: list[NodeView], model: str, tenant: str) -> list[tuple[str, str]]:
        policy = self.policy()
        return fallbacks(
            nodes,
            list(self.views.values()),
            model,
            lambda n: pool_rank(policy, tenant, n) is not None,
        )

    def serves(self, model: str) -> bool:
        return any(model in n.models for n in self.policy().nodes.values())

    async def fresh(self, max_age_s: float) -> None:
        """Make sure the views are at most `max_age_s` old: an idle dispatcher polls less often,
        and the first decision after a quiet spell reads first (one read shared by all)."""
        if self.clock() - self._read_at <= max_age_s:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self.refresh())
        await asyncio.shield(self._reading)

    async def refresh(self) -> None:
        """Read every node's published state, admin flag and lease count from Redis."""
        self._read_at = self.clock()
        views = list(self.views.values())
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        for v in views:
            pipe.get(keys.node_state(v.node.id))
            pipe.get(keys.node_admin(v.node.id))
            pipe.zcard(keys.node_leases(v.node.id))
            pipe.hmget(keys.node_ledger(v.node.id), "p", "t", "kv", "u", "r", "rt", "s")
            pipe.exists(keys.node_eject(v.node.id))
        outbox, self._outbox = self._outbox, []
        feed = keys.prefix_feed()
        for node, prefix in outbox:
            fields = {
                "s": self._me,
                "n": node,
                "t": prefix.block_tokens,
                "b": " ".join(prefix.blocks),
            }
            pipe.xadd(feed, fields, maxlen=FEED_LEN, approximate=True)
        pipe.xread({feed: self._feed_id}, count=FEED_READ)
        try:
            # Per-command errors come back in place: the feed's writes must not fail the reads
            # (a Redis refusing writes — OOM, READONLY — still serves node states).
            res = await pipe.execute(raise_on_error=False)
        except REDIS_DOWN:
            self.metrics.redis_errors.labels("refresh").inc()
            self._refresh_failed()
            return
        reads = 1 + 5 * len(views)
        if any(isinstance(r, Exception) for r in [*res[:reads], res[-1]]):
            self.metrics.redis_errors.labels("refresh").inc()
            self._refresh_failed()
            return
        if any(isinstance(r, Exception) for r in res[reads:-1]):
            self.metrics.redis_errors.labels("prefix_feed").inc()  # placements not told: harmless
        now = self._last_ok = self.clock()
        secs, micros = res[0]
        redis_now_us = int(secs) * 1_000_000 + int(micros)
        for i, v in enumerate(views):
            raw, admin, leases, (p, t, kv, u, r, rt, sh), ejected = res[1 + 5 * i : 6 + 5 * i]
            was = v.state
            v.observe(None if ejected else self._state(v.node.id, raw), bool(admin))
            if v.state == Status.DOWN and was != Status.DOWN:
                self.prefixes.drop_node(v.node.id)  # a restarted engine has an empty cache
            pending = float(p or 0)
            if t is not None and v.prefill_rate > 0:  # drained until Redis's now
                pending = max(0.0, pending - v.prefill_rate * (redis_now_us - int(t)) / 1e6)
            reserve = float(r or 0)
            if rt is not None:  # decayed until Redis's now, as lease.lua does
                reserve *= 0.5 ** (max(0, redis_now_us - int(rt)) / 1e6 / RESERVE_HALF_S)
            v.ledger(pending, int(kv or 0), int(leases), now, int(u or 0), reserve, int(sh or 0))
        self._learn_feed(res[-1])
        self._pressure(now)
        self._gauge()
        closed = (Status.DOWN, Status.DRAIN, Status.MAINTENANCE)
        unusable = frozenset(v.node.id for v in views if v.state in closed)
        if unusable != self.unusable:
            self.unusable = unusable
            if self.on_unusable is not None:
                self.on_unusable(unusable)

    def _learn_feed(self, read: Any) -> None:
        """Take the other sidecars' placements from the prefix feed (XREAD's reply)."""
        now = self.clock()
        for _stream, entries in read or []:
            for entry_id, f in entries:
                self._feed_id = entry_id
                if f.get(b"s", b"").decode() == self._me:
                    continue
                node = f.get(b"n", b"").decode()
                v = self.views.get(node)
                try:
                    prefix = Prefix(tuple(f.get(b"b", b"").decode().split()), int(f.get(b"t", 0)))
                except ValueError:
                    continue
                if v is not None and prefix:
                    self.prefixes.learn(node, prefix, now, pool_blocks(v.pool_tokens, prefix))

    def _pressure(self, now: float) -> None:
        """Track, per model, since when every live node serving it has been held."""
        held = (Status.HOLD, Status.DRAIN)
        for model in {m for v in self.views.values() for m in v.node.models}:
            live = [
                v
                for v in self.views.values()
                if model in v.node.models and v.state not in (Status.DOWN, Status.MAINTENANCE)
            ]
            if live and all(v.state in held for v in live):
                self.held_since.setdefault(model, now)
            elif self.held_since.pop(model, None) is not None:
                log.info("model %s: a node opened again; limits back to normal", model)

    def limit_factor(self, model: str, cls: str | None = None) -> float:
        """The factor on the refill rates of `cls` for `model` (1.0: normal). The most urgent
        class is never tightened (None: the factor for the classes below it)."""
        policy = self.policy()
        wm = policy.watermarks
        since = self.held_since.get(model)
        if since is None or wm.tighten_factor >= 1.0 or cls == next(iter(policy.classes)):
            return 1.0
        return wm.tighten_factor if self.clock() - since >= wm.tighten_after_s else 1.0

    def pressure_snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [
            {"model": m, "held_for_s": round(now - since, 1), "factor": self.limit_factor(m)}
            for m, since in sorted(self.held_since.items())
        ]

    def _state(self, node: str, raw: bytes | None) -> NodeState | None:
        if raw is None:
            return None
        try:
            return NodeState.from_json(raw)
        except ValueError as exc:
            if node not in self._bad_state_logged:  # once per node: it repeats every refresh
                self._bad_state_logged.add(node)
                log.error(
                    "node %s: unreadable state from its agent, treated as down: %s", node, exc
                )
            return None

    def _refresh_failed(self) -> None:
        if self.clock() - self._last_ok < self.policy().watermarks.stale_after_s:
            return  # keep the last view through a blip
        fail_open = self.policy().redis.failure_mode == FailureMode.OPEN
        for v in self.views.values():
            if v.state != Status.MAINTENANCE:
                v.state = Status.OPEN if fail_open else Status.DOWN

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
            await self.redis.set(keys.node_eject(node), "1", px=int(EJECT_S * 1000))
            await self.redis.delete(fails_key)
        except Exception as exc:
            if not is_down(exc):
                raise
            return
        self.views[node].state = Status.DOWN
        self.metrics.node_ejections.labels(node).inc()
        log.warning(
            "node %s: %d proxied requests failed to reach it within %ss; out of rotation for %ss",
            node,
            EJECT_AFTER,
            EJECT_S,
            EJECT_S,
        )

    async def set_maintenance(self, node: str, on: bool) -> None:
        if on:
            await self.redis.set(keys.node_admin(node), "drain")
        else:
            await self.redis.delete(keys.node_admin(node))
        await self.refresh()

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [v.snapshot(now) for v in self.views.values()]

    def _gauge(self) -> None:
        m = self.metrics
        for v in self.views.values():
            for s in Status:
                m.node_state.labels(v.node.id, s.value).set(1 if v.state == s else 0)
            m.node_memory.labels(v.node.id).set(v.projected())
            m.node_inflight.labels(v.node.id).set(v.inflight)
            if v.prefix_hit_ratio is not None:
                m.node_prefix_hits.labels(v.node.id).set(v.prefix_hit_ratio)
        for model in self.policy().models():
            m.limit_factor.labels(model).set(self.limit_factor(model))
