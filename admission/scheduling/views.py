"""Node views: what this sidecar knows of a node. Pure.

A view holds the state its agent published (`NodeState`: measured memory, prefill rate), and
the node's ledger in Redis as of the last refresh (pending prefill, reserved KV and its urgent
and shared parts, leases), advanced locally by what this sidecar booked since.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from admission.nodes.state import NodeState, Status
from admission.policy import Node
from admission.scheduling.ask import Ask

RESERVE_HALF_S = 20.0  # the urgent reserve halves in this time (lease.lua's RESERVE_HALF_US)
CLOSED = (Status.DOWN, Status.DRAIN, Status.MAINTENANCE)  # nodes that take nothing new


@dataclass
class NodeView:
    node: Node
    state: Status = Status.DOWN
    memory: float = 0.0  # measured by the agent
    base_memory: float = 0.0  # measured memory that is not KV in use
    per_token: float = 0.0  # memory fraction one token of KV takes (0: unknown)
    prefill_rate: float = 0.0  # tokens/s at full load (0: not measured yet)
    tpot_s: float = 0.0  # seconds per output token running requests see now (0: unknown/idle)
    decode_s: float | None = None  # the same over the last seconds (None: not published)
    pending: float = 0.0  # ledger: pending prefill tokens, as of `pending_at` (local clock)
    pending_at: float = 0.0
    kv_reserved: int = 0  # ledger: KV tokens reserved by live leases
    kv_urgent: int = 0  # ledger: the part of kv_reserved the urgent class holds
    kv_shared: int = 0  # ledger: the part of kv_reserved that is shared prefix blocks held
    reserve: float = 0.0  # ledger: the urgent reserve (recent peak), as of `pending_at`
    inflight: int = 0
    waiting: int = 0  # the engine's own queue (requests), for operators
    prefix_hit_ratio: float | None = None  # the engine's prefix cache, for operators
    pool_tokens: int = 0  # the engine's KV pool in tokens (0: unknown): its prefix cache's room
    since: float = 0.0  # when this sidecar saw the state change last (epoch seconds; 0: never)
    observed: bool = False  # a state was read (or found missing) at least once

    def observe(self, st: NodeState | None, maintenance: bool) -> None:
        """Take the agent's latest state (None: silent → down) and the operator's flag."""
        self.observed = True
        if st is None:
            self.state = Status.DOWN
            return
        self.state = Status.MAINTENANCE if maintenance else st.state
        self.memory = st.memory
        self.base_memory = st.base_memory
        self.per_token = st.per_token
        self.prefill_rate = st.prefill_rate
        self.tpot_s = st.tpot_s
        self.decode_s = st.decode_s
        self.waiting = st.waiting
        self.prefix_hit_ratio = st.prefix_hit_ratio
        self.pool_tokens = st.kv_pool_tokens or 0

    def ledger(
        self,
        pending: float,
        kv: int,
        leases: int,
        now: float,
        urgent: int | None = None,
        reserve: float | None = None,
        shared: int | None = None,
    ) -> None:
        """Take the node's ledger as read from Redis (pending and reserve decayed to `now`);
        without `urgent`/`reserve` (a refusal's figures) the local reserve is kept, decayed."""
        if urgent is None or reserve is None:
            urgent, reserve = self.kv_urgent, self.reserve_now(now)
        self.pending, self.pending_at, self.kv_reserved, self.inflight = pending, now, kv, leases
        self.kv_urgent, self.reserve = urgent, reserve
        if shared is not None:
            self.kv_shared = shared

    def seen(self, figures: tuple[int, float, int] | None, now: float) -> None:
        """Take a granted lease's reply (every sidecar's bookings as of then) without losing
        what this sidecar booked since it was sent: the larger of each; a refresh resets."""
        if figures is None:
            return
        n, pending, kv = figures
        self.inflight, self.kv_reserved = max(self.inflight, n), max(self.kv_reserved, kv)
        self.pending, self.pending_at = max(self.pending_now(now), pending), now

    def reserve_now(self, now: float) -> float:
        return float(self.reserve * 0.5 ** (max(0.0, now - self.pending_at) / RESERVE_HALF_S))

    def pending_now(self, now: float) -> float:
        if self.inflight <= 0:  # nothing in flight: nothing pending (lease.lua says the same)
            return 0.0
        if self.prefill_rate <= 0:
            return self.pending
        return max(0.0, self.pending - self.prefill_rate * (now - self.pending_at))

    def wait_s(self, now: float) -> float:
        """Seconds until this node has cleared the prefill booked on it."""
        return self.pending_now(now) / self.prefill_rate if self.prefill_rate > 0 else 0.0

    def projected(self, extra_kv: int = 0, urgent: bool = False) -> float:
        """Memory fraction the node will hold: measured, or base + reserved KV if larger.
        `urgent`: as the urgent class sees it, without the KV lower classes hold — vLLM's
        priority scheduling preempts them to make room for it (measured memory is then
        counted less their booking, but never below base + the urgent KV)."""
        if self.per_token <= 0:
            return self.memory
        if not urgent:
            return max(
                self.memory, self.base_memory + (self.kv_reserved + extra_kv) * self.per_token
            )
        own = self.base_memory + (self.kv_urgent + self.kv_shared + extra_kv) * self.per_token
        return max(self.memory - self.preemptible(), own)

    def preemptible(self, most: float = 1.0) -> float:
        """Memory fraction of the KV lower classes hold here (0 when unknown): what they booked,
        or their booked share of the KV measured in use if that is more, up to `most` times
        their booking. The edge's token estimate can be far under what the engine's tokenizer
        makes of a prompt (a real node's tiny model: 3.2 tokens for 4 characters), and their
        bookings then stand for more memory than their tokens say. `most`: the edge's
        `chars_per_token` (a token is rarely less than one character); past it the KV in use is
        not theirs (traffic the ledger does not see), and holds the urgent class as before.
        Shared prefix blocks are not counted: the urgent class may hold them."""
        lower = max(0, self.kv_reserved - self.kv_urgent - self.kv_shared)
        if lower == 0 or self.per_token <= 0:
            return 0.0
        booked = lower * self.per_token
        in_use = max(0.0, self.memory - self.base_memory)
        return max(booked, min(in_use * lower / self.kv_reserved, booked * most))

    def booked(self, ask: Ask, now: float) -> None:
        """A lease this sidecar took: count it until the next refresh reads the ledger."""
        reserve = self.reserve_now(now)
        if ask.urgent:
            self.kv_urgent += ask.new_kv
            reserve = max(reserve, self.kv_urgent)
        self.reserve = reserve
        self.pending = self.pending_now(now) + (ask.prefill_tokens if self.prefill_rate > 0 else 0)
        self.pending_at = now
        self.kv_reserved += ask.new_kv
        self.inflight += 1

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "node": self.node.id,
            "url": self.node.url,
            "models": list(self.node.models),
            "state": self.state.value,
            "state_since": round(self.since, 3) or None,
            "memory": round(self.memory, 4),
            "projected_memory": round(self.projected(), 4),
            "pending_prefill_tokens": round(self.pending_now(now)),
            "prefill_rate": round(self.prefill_rate, 1),
            "tpot_ms": round(self.tpot_s * 1000, 1),
            "decode_ms": None if self.decode_s is None else round(self.decode_s * 1000, 1),
            "kv_reserved_tokens": self.kv_reserved,
            "kv_urgent_tokens": self.kv_urgent,
            "urgent_reserve_tokens": round(self.reserve_now(now)),
            "inflight": self.inflight,
            "max_inflight": self.node.max_inflight,
            "waiting": self.waiting,
            "prefix_cache_hit_ratio": self.prefix_hit_ratio,
        }


def fail_over(views: Iterable[NodeView], fail_open: bool) -> None:
    """Redis gone past stale_after_s: fail-open opens the nodes last seen taking work (held ones
    too: nobody measures them now) or never read, as the edge's own fail-open does (its table's
    `serving`); one last seen down, draining or in maintenance stays closed. Fail-closed: every
    node down but those in maintenance."""
    kept = CLOSED if fail_open else (Status.MAINTENANCE,)
    for v in views:
        if v.state not in kept or not v.observed:
            v.state = Status.OPEN if fail_open else Status.DOWN
