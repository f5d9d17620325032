"""Gates: whether one node, as this sidecar sees it, takes one request now, and what the
request asks of it there (its `Ask`). Pure. lease.lua applies the same rules on the ledger.

The limits, all from the node's own figures (no per-engine constant):
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

from admission.nodes.state import Status
from admission.policy import Policy
from admission.scheduling.ask import Ask, Request
from admission.scheduling.prefixes import pool_blocks
from admission.scheduling.views import NodeView

_LIVE = (Status.OPEN, Status.HOLD)
_URGENT_LIVE = (Status.OPEN, Status.HOLD, Status.DRAIN)
DEFAULT_TARGET_TTFT_S = 1.0  # when no class sets slo.ttft_ms


def target_ttft_s(policy: Policy) -> float:
    """The TTFT the prefill budget protects: the most urgent class's target."""
    for c in policy.classes.values():
        if c.slo_ttft_ms:
            return c.slo_ttft_ms / 1000
    return DEFAULT_TARGET_TTFT_S


def ask_for(
    v: NodeView,
    policy: Policy,
    req: Request,
    *,
    lent: bool = False,
    urgent_waiting: int = 0,
    decode_s: float | None,
    own_decode_s: float | None = None,
    hit_blocks: int = 0,
) -> Ask:
    """The lease request for a node: this request's ledger entry and its class's limits there.
    `lent`: the node is another tenant's pool's, on loan: never urgent there.
    `urgent_waiting`: urgent KV waiting in this sidecar's queue, this node's share.
    `decode_s`: the decode guard's limit for lower classes (answer_lengths.decode_limit_s; None:
    no guard) — required, so that no caller drops the guard by leaving it out;
    `own_decode_s`: the urgent class's own (answer_lengths.own_decode_limit_s).
    `req.waited_s`: how long the request has waited here: the urgent class's budget is what is
    left of its target (sent with less, it would have its first token late: it waits, and is
    refused early instead).
    `hit_blocks`: how much of the prompt's head this sidecar expects the node to hold;
    lease.lua books only the rest."""
    cls, prefix = req.cls, req.prefix
    wm = policy.watermarks

    def tokens(fraction: float) -> int:
        return max(0, int((fraction - v.base_memory) / v.per_token)) if v.per_token > 0 else -1

    hurry = policy.is_urgent(cls) and not lent
    # Every class goes to a node only while its booked prefill clears within the target TTFT:
    # past that no order serves it in time there. The urgent class too when it refuses late
    # (`on_late: refuse`): it then waits in the sidecar, where it is refused early, instead of
    # inside the engine; when it serves late, vLLM's priority runs it first there.
    gated = not hurry or (cls is not None and policy.classes[cls].refuses_late)
    ttft = target_ttft_s(policy) - (req.waited_s if hurry else 0.0)
    budget = 0 if not gated or v.prefill_rate <= 0 else max(1, int(v.prefill_rate * ttft))
    return Ask(
        req.prompt,
        req.kv,
        v.prefill_rate,
        budget,
        tokens(wm.drain if hurry else wm.hold),
        urgent=hurry,
        reserve_limit=-1 if hurry else tokens(wm.drain),
        urgent_waiting=0 if hurry else urgent_waiting,
        decode_limit_s=(own_decode_s if hurry else decode_s) or 0.0,
        prefix=prefix,
        pool_blocks=pool_blocks(v.pool_tokens, prefix),
        hit_tokens=min(req.prompt, prefix.tokens(hit_blocks)),
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
    hurry = policy.is_urgent(cls) and not lent
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
        # nor urgent work that would finish late there anyway (answer_lengths.own_decode_limit_s)
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
