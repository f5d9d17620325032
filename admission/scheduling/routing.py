"""Routing: which nodes may take a request of a class now, best first. Pure.

Judged on this sidecar's node views (views.py); the ledger decides, the views only avoid
asking Redis for leases that would be refused.

Two limits, both from the node's own figures (no per-engine constant):
- memory: the larger of measured memory and base + reserved KV must stay below the class's
  watermark (`hold`, or `drain` for a class admitted until drain): KV is reserved for prompt +
  output cap, so admitted lower-class work cannot outgrow the pool. The urgent class counts
  neither the KV lower classes booked nor that part of measured memory (`preemptible`): vLLM
  preempts them for it;
- prefill: classes admitted until `hold` go to a node only while its pending prefill stays
  within what it clears in the target TTFT (the most urgent class's `slo.ttft_ms`), from its
  measured prefill rate: the backlog stays in the sidecar, where fairness and SLO order apply,
  not inside vLLM. While the urgent class has KV booked on the node, lower classes get only its
  idle prefill (one goes there when the prefill booked has cleared): vLLM does not preempt a
  prefill that has started, every lower-class prompt slows the urgent class's decode and
  queueing, and routing by pending prefill then sees the urgent class's own backlog;
- decode: nor while the node's measured time per output token is above what the most urgent
  class may see: its `slo.tpot_ms`, tightened to what its `slo.e2e_ms` asks of its answers as
  long as they really are (answer_lengths.py); lower-class prefill chunks and KV slow every running
  decode. Only while the urgent class is present (KV booked on a node serving the model, or
  waiting): with none, lower classes take the whole cluster. Nor for a class admitted less
  than its `min_share` of the tokens over the last seconds (`owed`): the policy guarantees it
  that share, and under overload the guard alone kept batch at a twentieth of the tokens
  (support mix at 2.0×: docs/benchmarks.md);
- urgent reserve: other classes keep their KV + the urgent class's recent peak on the node
  (or what it has now plus what of it waits) below the drain watermark, so realtime is never
  held behind work that vLLM would have to preempt for it, however few requests the band
  between the watermarks holds (a tiny KV pool).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from admission.nodes.state import Status
from admission.policy import AdmitUntil, Node, Policy
from admission.scheduling.answer_lengths import decode_limit_s, own_decode_limit_s
from admission.scheduling.ask import Ask
from admission.scheduling.prefixes import NO_PREFIX, Prefix, home_rank, pool_blocks
from admission.scheduling.views import NodeView

MAX_FALLBACKS = 2
_LIVE = (Status.OPEN, Status.HOLD)
_URGENT_LIVE = (Status.OPEN, Status.HOLD, Status.DRAIN)
DEFAULT_TARGET_TTFT_S = 1.0  # when no class sets slo.ttft_ms
# Bounded load (as consistent hashing with bounded loads, Mirrokni et al. 2018): a node with more
# than LOAD_FACTOR × the fewest requests in flight of the nodes that would take a request, plus
# LOAD_SLACK, loses its cache preference: prefill saved once does not pay for a crowded node's
# decode, which every request running there sees on every token.
LOAD_FACTOR = 1.25
LOAD_SLACK = 8
HOLDS_SHARE = 0.3  # a node holding this share of a prompt goes first (`eligible`; vllm-router's)


def urgent(policy: Policy, cls: str | None) -> bool:
    """A class admitted until drain: not held back by memory lower classes hold, nor by the
    idle-prefill rule (vLLM's priority scheduling runs it first inside the engine); its own
    prefill budget applies when it refuses late (`ClassPolicy.refuses_late`)."""
    c = policy.classes.get(cls) if cls else None
    return c is not None and c.admit_until == AdmitUntil.DRAIN


def target_ttft_s(policy: Policy) -> float:
    """The TTFT the prefill budget protects: the most urgent class's target."""
    for c in policy.classes.values():
        if c.slo_ttft_ms:
            return c.slo_ttft_ms / 1000
    return DEFAULT_TARGET_TTFT_S


def ask_for(
    v: NodeView,
    policy: Policy,
    cls: str | None,
    prompt: int,
    kv: int,
    lent: bool = False,
    urgent_waiting: int = 0,
    *,
    decode_s: float | None,
    own_decode_s: float | None = None,
    prefix: Prefix = NO_PREFIX,
    hit_blocks: int = 0,
    waited_s: float = 0.0,
) -> Ask:
    """The lease request for a node: this request's ledger entry and its class's limits there.
    `lent`: the node is another tenant's pool's, on loan: never urgent there.
    `urgent_waiting`: urgent KV waiting in this sidecar's queue, this node's share.
    `decode_s`: the decode guard's limit for lower classes (outputs.decode_limit_s; None:
    no guard) — required, so that no caller drops the guard by leaving it out;
    `own_decode_s`: the urgent class's own (outputs.own_decode_limit_s).
    `waited_s`: how long the request has waited here: the urgent class's budget is what is left
    of its target (sent with less, it would have its first token late: it waits, and is
    refused early instead).
    `prefix`, `hit_blocks`: the prompt's head and how much of it this sidecar expects the node
    to hold; lease.lua books only the rest."""
    wm = policy.watermarks

    def tokens(fraction: float) -> int:
        return max(0, int((fraction - v.base_memory) / v.per_token)) if v.per_token > 0 else -1

    hurry = urgent(policy, cls) and not lent
    # Every class goes to a node only while its booked prefill clears within the target TTFT:
    # past that no order serves it in time there. The urgent class too when it refuses late
    # (`on_late: refuse`): it then waits in the sidecar, where it is refused early, instead of
    # inside the engine; when it serves late, vLLM's priority runs it first there.
    gated = not hurry or (cls is not None and policy.classes[cls].refuses_late)
    ttft = target_ttft_s(policy) - (waited_s if hurry else 0.0)
    budget = 0 if not gated or v.prefill_rate <= 0 else max(1, int(v.prefill_rate * ttft))
    return Ask(
        prompt,
        kv,
        v.prefill_rate,
        budget,
        tokens(wm.drain if hurry else wm.hold),
        urgent=hurry,
        reserve_limit=-1 if hurry else tokens(wm.drain),
        urgent_waiting=0 if hurry else urgent_waiting,
        decode_limit_s=(own_decode_s if hurry else decode_s) or 0.0,
        prefix=prefix,
        pool_blocks=pool_blocks(v.pool_tokens, prefix),
        hit_tokens=min(prompt, prefix.tokens(hit_blocks)),
    )


def booked_kv(v: NodeView, ask: Ask) -> int:
    """KV the node would have booked with this ask, as its class's memory gate counts it: the
    urgent class only its own and the shared prefix blocks (vLLM preempts the rest for it)."""
    return (v.kv_urgent + v.kv_shared if ask.urgent else v.kv_reserved) + ask.new_kv


def keeps_reserve(v: NodeView, ask: Ask, now: float) -> bool:
    """Whether a lower-class ask leaves the urgent reserve free (lease.lua decides)."""
    if ask.urgent or ask.reserve_limit < 0:
        return True
    reserve = max(v.kv_urgent + ask.urgent_waiting, v.reserve_now(now))
    return v.kv_reserved - v.kv_urgent + ask.new_kv + reserve <= ask.reserve_limit


# Why a node said no to a request (`admission_node_gate_total{reason}`).
GATE_REASONS = ("state", "inflight", "measured", "booked", "decode", "reserve", "prefill")


def why_not(
    v: NodeView, ask: Ask, policy: Policy, cls: str | None, now: float, lent: bool = False
) -> str | None:
    """None if the node, as this sidecar sees it, would grant `ask` (the ledger decides);
    otherwise the first rule that says no (one of GATE_REASONS)."""
    hurry = urgent(policy, cls) and not lent
    # A node drained by its memory is still open to the urgent class while what lower classes
    # hold there is what puts it over: vLLM preempts them for it (the reserve makes it rare).
    if v.state not in (_URGENT_LIVE if hurry else (Status.OPEN,)):
        return "state"  # held, drained, down or in maintenance for this class
    if v.inflight >= v.node.max_inflight:
        return "inflight"
    limit = policy.watermarks.drain if hurry else policy.watermarks.hold
    if v.memory - (v.preemptible(policy.edge.chars_per_token) if hurry else 0.0) >= limit:
        return "measured"
    if ask.kv_limit >= 0 and booked_kv(v, ask) > ask.kv_limit:
        return "booked"  # the watermark in tokens (ask_for), as lease.lua checks it
    if ask.decode_limit_s and slow_decode(v, ask.urgent, ask.decode_limit_s):
        return "decode"  # decode already as slow as the urgent class may see: no more batch,
        # nor urgent work that would finish late there anyway (outputs.own_decode_limit_s)
    if not keeps_reserve(v, ask, now):
        return "reserve"
    pending = v.pending_now(now)
    if (
        ask.prefill_budget > 0
        and pending > 0
        and pending + ask.prefill_tokens > prefill_room(v, ask)
    ):
        return "prefill"
    return None


def slow_decode(v: NodeView, urgent: bool, limit_s: float) -> bool:
    """Whether the node's decode is past a guard's limit: the last sample's time per output
    token (Tpot) is above it — and, for the urgent class's own guard, what answers saw over the
    last second or so (decode_s) is above half of it. Tpot's spikes keep a margin against lower
    classes; but a long prefill step spikes it where answers come fast (llm-d-like mix: 40–300
    ms read, under 60 ms seen): the own guard held realtime off every node, −20–30 points."""
    if v.tpot_s <= limit_s:
        return False
    return not urgent or v.decode_s is None or v.decode_s > limit_s / 2


def prefill_room(v: NodeView, ask: Ask) -> int:
    """Pending prefill an ask may bring a busy node to: its budget; for a lower class none while
    the urgent class has KV booked there (only idle prefill; lease.lua decides the same)."""
    return 0 if v.kv_urgent > 0 and not ask.urgent else ask.prefill_budget


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
    model: str,
    cls: str | None,
    prompt: int,
    kv: int,
    now: float,
    tenant: str | None = None,
    blocked: frozenset[str] = frozenset(),
    urgent_waiting: int = 0,
    gate: Counter[tuple[str, str, str]] | None = None,
    output_tokens: float = 0.0,
    prefix: Prefix = NO_PREFIX,
    hits: dict[str, int] | None = None,
    *,
    present: bool | None = None,
    live: int | None = None,
    refusing: bool = False,
    waited_s: float = 0.0,
    owed: bool = False,
) -> list[tuple[NodeView, Ask]]:
    """Nodes serving `model` that would take this request now, with their asks: the tenant's
    own pool first, then shared nodes, then idle pools on loan (`pool_rank`); within each, for
    lower classes the nodes where the urgent class has no KV booked first; then the prompt's
    holders; then the soonest first token (booked prefill less what the cache saves), then the
    least projected memory. `gate`: counts (node, class, reason) of every node that said no.
    `output_tokens`: the urgent class's mean answer length (outputs.UrgentOutputs; 0: unknown).
    `prefix`, `hits`: the prompt's head and, per node, how many of its blocks this sidecar
    expects there (prefixes.PrefixIndex.matches). Nodes holding HOLDS_SHARE of the prompt, under
    the load bound, go before any sooner node holding less: sent elsewhere, a request recomputes
    its prefix there (work taken from everyone) and its copy crowds other prefixes out of that
    pool (llm-d-like mix at 2.0×, sent to the soonest first token: 2 runs of 11 fell to 61–67 %
    hits and 53–81 % realtime in time, against 72 % and ~91 %; docs/benchmarks.md). It spreads
    when its holders say no: booked prefill past the class's budget (a late first token), the
    load bound, memory, the decode guard. `present`, `live`: whether the urgent class is
    present on the model's nodes and how many of them are live, when `views` are not all of
    them. `refusing`: the class is being refused late (past what any order serves): the urgent
    class's own decode guard acts (outputs.own_decode_limit_s), and its budget is what is left
    of its target after `waited_s` (ask_for). Within capacity neither: the ledger's estimates
    err long, and a request past them on paper often still has its first token in time.
    `owed`: the class was admitted under its min_share lately: the decode guard lets it by."""
    ok = []
    # `views` may be the few candidates examined (candidates.py): whether the urgent class is
    # present and how many nodes share its waiting KV are the whole model's, when given.
    if present is None:
        present = urgent_present(views, model, urgent_waiting)
    decode_s = decode_limit_s(policy, output_tokens) if present and not owed else None
    own_s = (
        own_decode_limit_s(policy, cls, output_tokens)
        if refusing and cls and urgent(policy, cls)
        else None
    )
    share = 0  # waiting urgent KV, spread over the live nodes serving the model
    if urgent_waiting:
        if live is None:
            live = sum(1 for v in views if model in v.node.models and v.state in _LIVE)
        share = urgent_waiting // max(1, live)
    for v in views:
        if model not in v.node.models:
            continue
        rank = pool_rank(policy, tenant, v.node, blocked) if policy.pools else 1
        if rank is None:
            continue
        # Borrowed capacity is held to the hold watermark and the prefill budget even for an
        # urgent class: the band above hold and the prefill room stay the owners'.
        hit = hits.get(v.node.id, 0) if hits else 0
        ask = ask_for(
            v,
            policy,
            cls,
            prompt,
            kv,
            lent=rank == 2,
            urgent_waiting=share,
            decode_s=decode_s,
            own_decode_s=own_s,
            prefix=prefix,
            hit_blocks=hit,
            waited_s=waited_s if refusing else 0.0,
        )
        reason = why_not(v, ask, policy, cls, now, lent=rank == 2)
        if reason is None:
            ok.append((rank, v, ask))
        elif gate is not None:
            gate[(v.node.id, cls or "", reason)] += 1
    # Lower classes first where the urgent class has no KV booked (they slow no urgent decode
    # there); then the prompt's holders; past the load bound a node holds none (not `kept`).
    apart = not urgent(policy, cls)
    bound = LOAD_FACTOR * min((v.inflight for _r, v, _a in ok), default=0) + LOAD_SLACK

    def order(rva: tuple[int, NodeView, Ask]) -> tuple[Any, ...]:
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

    ok.sort(key=order)
    return [(v, ask) for _rank, v, ask in ok]


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
