"""The demand signal: per model, how many nodes the current demand needs to meet its classes'
targets — what an autoscaler reads (`admission_model_nodes_needed`, `/status.json` "demand").
Pure: time and the node views are passed in.

The method, in three steps:

1. **How busy the serving nodes are.** Each node open or held for the model counts its
   utilisation by the resource that binds it first: requests in flight over `max_inflight`,
   projected KV memory (measured, or the ledger's reserved KV at the node's measured cost per
   token, above the memory weights take) over what the hold watermark leaves, and pending
   prefill over what the node clears within the most urgent class's TTFT target at its
   measured prefill rate. The sum is `busy`, in nodes;
   while requests wait in the queue every serving node counts as full (the product holds work
   in its queue well before a node's resources run out: the queue is the overflow).
2. **How much more is asked than served.** Over the last WINDOW_S, requests admitted (A) and
   refused for want of capacity (R: `slo_unreachable`, `over_fair_share`, `queue_timeout`,
   `queue_full`, `no_capacity`), and the requests waiting now (W): the demand factor is
   (A + R + W) / A — 1 when everything asked is served, 2 when as much again is turned away.
3. **Nodes needed** = ceil(busy × factor / TARGET_UTILISATION), at least 1 while anything is
   asked (with nothing admitted: one more than busy counts), 0 after a quiet window: at
   TARGET_UTILISATION the nodes keep headroom for bursts and for the prefill budget's slack.

A sidecar sees every node (the ledgers are shared) and its own share of the requests; with the
edge spreading requests over the sidecars each arrives at about the same figure. An autoscaler
takes the largest over the sidecars.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

from admission.metrics import Metrics
from admission.nodes.state import Status
from admission.policy import Policy
from admission.scheduling.queue import FairQueue
from admission.scheduling.views import NodeView

WINDOW_S = 60.0  # the demand factor's window
BUCKET_S = 5.0  # counted in buckets of this length
TARGET_UTILISATION = 0.8  # a node counted full at this share of its binding resource
# Refusals that say the cluster is short (a tenant's own limits, bad requests: not capacity).
SHORT = frozenset(
    {"slo_unreachable", "over_fair_share", "queue_timeout", "queue_full", "no_capacity"}
)
SERVING = (Status.OPEN, Status.HOLD)


class Demand:
    """Per model: admitted and refused-for-capacity counts over the last WINDOW_S."""

    def __init__(self) -> None:
        self._buckets: dict[str, deque[list[float]]] = {}  # model → [start, admitted, short]

    def decided(self, model: str, outcome: str, reason: str, now: float) -> None:
        """One admission decision: counted as admitted, short of capacity, or neither."""
        short = reason in SHORT
        if outcome != "admitted" and not short:
            return
        buckets = self._buckets.setdefault(model, deque())
        if not buckets or now - buckets[-1][0] >= BUCKET_S:
            buckets.append([now, 0.0, 0.0])
        buckets[-1][1 if outcome == "admitted" else 2] += 1
        while buckets and now - buckets[0][0] > WINDOW_S:
            buckets.popleft()

    def counts(self, model: str, now: float) -> tuple[float, float]:
        """(admitted, short) over the window ending `now`."""
        buckets = self._buckets.get(model, ())
        live = [b for b in buckets if now - b[0] <= WINDOW_S]
        return sum(b[1] for b in live), sum(b[2] for b in live)

    def estimate(
        self,
        policy: Policy,
        views: Iterable[NodeView],
        waiting: dict[str, int],
        now: float,
    ) -> dict[str, dict[str, Any]]:
        """Model → serving nodes, nodes needed and the figures they come from."""
        ttft_s = next((c.slo_ttft_ms / 1000 for c in policy.classes.values() if c.slo_ttft_ms), 1.0)
        hold = policy.watermarks.hold
        out: dict[str, dict[str, Any]] = {}
        by_model: dict[str, list[NodeView]] = {m: [] for m in policy.models()}
        for v in views:
            if v.state in SERVING:
                for m in v.node.models:
                    by_model.setdefault(m, []).append(v)
        for model, serving in sorted(by_model.items()):
            admitted, short = self.counts(model, now)
            w = waiting.get(model, 0)
            busy = sum(utilisation(v, hold, ttft_s, now) for v in serving)
            if w:  # requests wait: what the nodes could not take; every one of them is full
                busy = max(busy, float(len(serving)))
            asked = admitted + short + w
            factor = asked / admitted if admitted else 1.0
            needed = 0
            if asked and admitted:
                needed = max(1, math.ceil(busy * factor / TARGET_UTILISATION - 1e-9))
            elif asked:  # nothing admitted (no node serves, or none has room): one more
                needed = math.ceil(busy / TARGET_UTILISATION - 1e-9) + 1
            out[model] = {
                "serving": len(serving),
                "needed": needed,
                "busy": round(busy, 2),
                "demand_factor": round(factor, 2),
                "admitted_60s": int(admitted),
                "short_60s": int(short),
                "waiting": w,
            }
        return out


def utilisation(v: NodeView, hold: float, ttft_s: float, now: float) -> float:
    """The node's busiest resource as a share of what it may take (capped at 2)."""
    # Memory: the KV part (above what weights and activations take) of what the node may
    # hold before new work waits.
    room = hold - v.base_memory
    kv = (v.projected() - v.base_memory) / room if room > 0 else float(v.projected() >= hold)
    shares = [v.inflight / max(1, v.node.max_inflight), max(0.0, kv)]
    if v.prefill_rate > 0:
        shares.append(v.pending_now(now) / (v.prefill_rate * ttft_s))
    return min(2.0, max(shares))


class DemandSignal:
    """The signal of one sidecar: its decisions counted, the node views and its queue read,
    the `admission_model_nodes_needed` gauge set at most once a second."""

    def __init__(
        self,
        policy: Callable[[], Policy],
        views: Callable[[], Iterable[NodeView]],
        queue: FairQueue,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self.policy, self.views, self.queue = policy, views, queue
        self.metrics, self.clock = metrics, clock
        self.demand = Demand()
        self._published = 0.0

    def decided(self, model: str, outcome: str, reason: str) -> None:
        self.demand.decided(model, outcome, reason, self.clock())

    def now(self) -> dict[str, dict[str, Any]]:
        """Per model: nodes serving, nodes needed and the figures they come from."""
        waiting = Counter(item.model for item in self.queue.items())
        return self.demand.estimate(self.policy(), self.views(), dict(waiting), self.clock())

    def publish(self, now: float) -> None:
        if now - self._published < 1.0:
            return
        self._published = now
        for model, d in self.now().items():
            self.metrics.model_nodes_needed.labels(model).set(d["needed"])
