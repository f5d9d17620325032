"""Routing: which nodes may take a request of a class now, best first. Pure.

Judged on this sidecar's node views (views.py); the ledger decides, the views only avoid
asking Redis for leases that would be refused. Whether one node takes one request is gates.py;
this module picks among those that do: the tenant's pool, the urgent class's nodes avoided by
lower classes, the prompt's holders under a load bound, then the soonest first token.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from admission.policy import Node, Policy
from admission.scheduling.answer_lengths import decode_limit_s, own_decode_limit_s
from admission.scheduling.ask import Ask, Request
from admission.scheduling.gates import _LIVE, ask_for, why_not
from admission.scheduling.prefixes import Prefix, home_rank
from admission.scheduling.views import NodeView

MAX_FALLBACKS = 2
# Bounded load (as consistent hashing with bounded loads, Mirrokni et al. 2018): a node with more
# than LOAD_FACTOR × the fewest requests in flight of the nodes that would take a request, plus
# LOAD_SLACK, loses its cache preference: prefill saved once does not pay for a crowded node's
# decode, which every request running there sees on every token.
LOAD_FACTOR = 1.25
LOAD_SLACK = 8
HOLDS_SHARE = 0.3  # a node holding this share of a prompt goes first (`eligible`; vllm-router's)


@dataclass(frozen=True, slots=True)
class ClusterFacts:
    """What this sidecar knows around a request when it routes it: read once per decision."""

    now: float
    blocked: frozenset[str] = frozenset()  # pools not lent now: their owners wait
    urgent_waiting: int = 0  # urgent KV waiting in this sidecar's queue
    output_tokens: float = 0.0  # the urgent class's mean answer length (0: unknown)
    hits: dict[str, int] | None = None  # node → blocks of the prompt's head expected there
    present: bool | None = None  # the urgent class on the model's nodes (None: count `views`)
    live: int | None = None  # live nodes serving the model (None: count `views`)
    refusing: bool = False  # the class is late (overload.py): past what any order serves
    owed: bool = False  # under its min_share while the urgent class is late (Overload.owed)


def pool_rank(
    policy: Policy, tenant: str | None, node: Node, blocked: frozenset[str] = frozenset()
) -> int | None:
    """Where a node stands for a tenant's request: 0 its own pool, 1 shared, 2 another pool's
    idle capacity on loan; None: not for this tenant now (a pool that does not lend, or whose
    owners wait — they take it back by admission order —, or shared nodes for owners whose pool
    does not spill)."""
    own = policy.tenant_pool.get(tenant) if tenant else None
    if node.pool is None:
        return 1 if own is None or policy.pools[own].spill else None
    if node.pool == own:
        return 0
    lender = policy.pools.get(node.pool)
    return 2 if lender is not None and lender.lend and node.pool not in blocked else None


def urgent_present(views: list[NodeView], model: str | None, urgent_waiting: int) -> bool:
    """Whether the decode guard acts: the urgent class has KV booked on a node serving `model`
    (None: any model), or waits. With neither (a quiet spell, the end of a burst) there is
    nothing to protect, and lower classes take the whole cluster's decode."""
    return urgent_waiting > 0 or any(
        v.kv_urgent > 0 for v in views if model is None or model in v.node.models
    )


def eligible(
    views: list[NodeView],
    policy: Policy,
    req: Request,
    facts: ClusterFacts,
    gate: Counter[tuple[str, str, str]] | None = None,
) -> list[tuple[NodeView, Ask]]:
    """Nodes serving `model` that would take this request now, with their asks: the tenant's
    own pool first, then shared nodes, then idle pools on loan (`pool_rank`); within each, for
    lower classes the nodes where the urgent class has no KV booked first; then the prompt's
    holders; then the soonest first token (booked prefill less what the cache saves), then the
    least projected memory. `gate`: counts (node, class, reason) of every node that said no.
    `facts.hits`: per node, how many blocks of the prompt's head this sidecar expects there
    (prefixes.PrefixIndex.matches). Nodes holding HOLDS_SHARE of the prompt, under
    the load bound, go before any sooner node holding less: sent elsewhere, a request recomputes
    its prefix there (work taken from everyone) and its copy crowds other prefixes out of that
    pool (llm-d-like mix at 2.0×, sent to the soonest first token: 2 runs of 11 fell to 61–67 %
    hits and 53–81 % realtime in time, against 72 % and ~91 %; docs/benchmarks.md). It spreads
    when its holders say no: booked prefill past the class's budget (a late first token), the
    load bound, memory, the decode guard. `facts.present`, `facts.live`: whether the urgent
    class is present on the model's nodes and how many of them are live, when `views` are not
    all of them. `facts.refusing`: the class is late (overload.py: past what any order serves):
    the urgent class's own decode guard acts (answer_lengths.own_decode_limit_s), and its budget
    is what is left of its target after `req.waited_s` (ask_for). Within capacity neither: the
    ledger's estimates err long, and a request past them on paper often still has its first
    token in time. `facts.owed`: the class was admitted under its min_share lately
    (Overload.owed): the decode guard lets it by."""
    model, cls, now = req.model, req.cls, facts.now
    decode_s, own_s, share = guards(views, policy, req, facts)
    if req.waited_s and not facts.refusing:
        req = replace(req, waited_s=0.0)  # within capacity, the whole target (ask_for)
    ok = []
    for v in views:
        if model not in v.node.models:
            continue
        rank = pool_rank(policy, req.tenant, v.node, facts.blocked) if policy.pools else 1
        if rank is None:
            continue
        # Borrowed capacity is held to the hold watermark and the prefill budget even for an
        # urgent class: the band above hold and the prefill room stay the owners'.
        hit = facts.hits.get(v.node.id, 0) if facts.hits else 0
        ask = ask_for(
            v,
            policy,
            req,
            lent=rank == 2,
            urgent_waiting=share,
            decode_s=decode_s,
            own_decode_s=own_s,
            hit_blocks=hit,
        )
        reason = why_not(v, ask, policy, cls, now, lent=rank == 2)
        if reason is None:
            ok.append((rank, v, ask))
        elif gate is not None:
            gate[(v.node.id, cls or "", reason)] += 1
    ok.sort(key=partial(_order, not policy.is_urgent(cls), _bound(ok), req.prefix, now))
    return [(v, ask) for _rank, v, ask in ok]


def guards(
    views: list[NodeView], policy: Policy, req: Request, facts: ClusterFacts
) -> tuple[float | None, float | None, int]:
    """The decode guard's limit for lower classes, the urgent class's own (None: none acts),
    and the waiting urgent KV each live node serving the model keeps free. `views` may be the
    few candidates examined (candidates.py): whether the urgent class is present and how many
    nodes share its waiting KV are the whole model's, when `facts` give them."""
    model, cls, waiting = req.model, req.cls, facts.urgent_waiting
    present = facts.present
    if present is None:
        present = urgent_present(views, model, waiting)
    out = facts.output_tokens
    decode_s = decode_limit_s(policy, out) if present and not facts.owed else None
    own_s = None
    if facts.refusing and cls and policy.is_urgent(cls):
        own_s = own_decode_limit_s(policy, cls, out)
    share = 0  # waiting urgent KV, spread over the live nodes serving the model
    if waiting:
        live = facts.live
        if live is None:
            live = sum(1 for v in views if model in v.node.models and v.state in _LIVE)
        share = waiting // max(1, live)
    return decode_s, own_s, share


def _bound(ok: list[tuple[int, NodeView, Ask]]) -> float:
    """The load bound: past it a node holds no prompt for the order (`LOAD_FACTOR`)."""
    return LOAD_FACTOR * min((v.inflight for _r, v, _a in ok), default=0) + LOAD_SLACK


def _order(
    apart: bool, bound: float, prefix: Prefix, now: float, rva: tuple[int, NodeView, Ask]
) -> tuple[Any, ...]:
    """Lower classes first where the urgent class has no KV booked (`apart`: they slow no
    urgent decode there); then the prompt's holders; past the load bound a node holds none."""
    rank, v, ask = rva
    kept = v.inflight <= bound
    return (
        rank,
        apart and v.kv_urgent > 0,
        not (kept and ask.hit_tokens >= HOLDS_SHARE * ask.prompt_tokens > 0),
        v.wait_s(now) - (saved_s(v, ask) if kept else 0.0),
        -ask.hit_tokens if kept else 0,
        v.projected(),
        home_rank(prefix, v.node.id),
        v.node.id,
    )


def saved_s(v: NodeView, ask: Ask) -> float:
    """Prefill seconds the node's prefix cache saves this request (0 when its rate is unknown)."""
    return ask.hit_tokens / v.prefill_rate if v.prefill_rate > 0 else 0.0


def eta_s(
    views: list[NodeView],
    model: str,
    prompt: int,
    now: float,
    cached: dict[str, int] | None = None,
) -> tuple[float, float]:
    """Soonest any live node serving `model` could have a `prompt`-token request prefilled:
    its booked prefill cleared, then this one (less what `cached[node]` tokens its prefix cache
    holds), at its measured rate (0 when none is known); and the same on an idle node (this
    one's prefill alone). (0, 0) when no node serves it."""
    cached = cached or {}
    soonest = alone = math.inf
    for v in views:
        if model not in v.node.models or v.state not in _LIVE:
            continue
        rate = v.prefill_rate
        own = max(0, prompt - cached.get(v.node.id, 0)) / rate if rate > 0 else 0.0
        soonest, alone = min(soonest, v.wait_s(now) + own), min(alone, own)
    return (0.0, 0.0) if alone == math.inf else (soonest, alone)


def fallbacks(
    nodes: list[NodeView],
    views: list[NodeView],
    model: str,
    usable: Callable[[Node], bool] = lambda _n: True,
) -> list[tuple[str, str]]:
    """(node id, url) of where the edge goes when the chosen node refuses the connection: the
    next eligible nodes, then any other live node serving the model (that the tenant may use:
    `usable`). A node that refuses connections has served nothing, so a held node beats a 502."""
    out = list(nodes[1 : 1 + MAX_FALLBACKS])
    if len(out) < MAX_FALLBACKS:
        taken = {v.node.id for v in nodes}
        live = sorted(
            (
                v
                for v in views
                if v.node.id not in taken
                and model in v.node.models
                and v.state in _LIVE
                and usable(v.node)
            ),
            key=lambda v: v.projected(),
        )
        out += live[: MAX_FALLBACKS - len(out)]
    return [(v.node.id, v.node.url) for v in out]
