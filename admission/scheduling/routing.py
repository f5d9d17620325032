"""Node views and routing: which nodes may take a request of a class now, best first. Pure.

A view is a node's published state (`NodeState`), the lease count from Redis, and what this
sidecar admitted to it within `projection_window_s` ("projected usage": an admission takes a
sample period plus queueing and prefill before its KV shows in the node's memory).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from admission.nodes.state import NodeState, Status
from admission.policy import AdmitUntil, Node, Policy

MAX_FALLBACKS = 2


@dataclass
class NodeView:
    node: Node
    state: Status = Status.DOWN
    memory: float = 0.0
    per_token: float = 0.0  # memory fraction one token of KV takes
    projected_tokens: int = 0  # admitted by this sidecar within the projection window
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (admitted at, tokens)
    inflight: int = 0
    waiting: int = 0

    def observe(self, st: NodeState | None, maintenance: bool, leases: int, seen_by: float) -> None:
        """Take a refresh: the agent's state (None: silent → down), the admin flag, leases."""
        if st is None:
            self.state = Status.DOWN
        else:
            self.state = Status.MAINTENANCE if maintenance else st.state
            self.memory = st.memory
            self.per_token = st.per_token
            self.waiting = st.waiting
            self.expire(seen_by)
        self.inflight = leases

    def projected(self) -> float:
        return self.memory + self.projected_tokens * self.per_token

    def admitted(self, now: float, tokens: int) -> None:
        self.recent.append((now, tokens))
        self.projected_tokens += tokens
        self.inflight += 1

    def expire(self, before: float) -> None:
        """Admissions older than `before` are assumed to show in the node's samples by now."""
        while self.recent and self.recent[0][0] < before:
            self.projected_tokens -= self.recent.popleft()[1]

    def load(self, hold: float) -> float:
        return max(self.projected() / hold, self.inflight / self.node.max_inflight)

    def snapshot(self, hold: float) -> dict[str, Any]:
        return {
            "node": self.node.id,
            "url": self.node.url,
            "models": list(self.node.models),
            "state": self.state.value,
            "memory": round(self.memory, 4),
            "projected_memory": round(self.projected(), 4),
            "inflight": self.inflight,
            "max_inflight": self.node.max_inflight,
            "waiting": self.waiting,
            "load": round(self.load(hold), 4),
        }


def eligible(views: list[NodeView], policy: Policy, model: str, cls: str | None) -> list[NodeView]:
    """Nodes serving `model` that may take a request of class `cls` now, least loaded first.

    Open nodes below the hold watermark (after projection) take every class; a class with
    `admit_until: drain` is also admitted to held nodes, up to the drain watermark.
    """
    wm = policy.watermarks
    c = policy.classes.get(cls) if cls else None
    until_drain = c is not None and c.admit_until == AdmitUntil.DRAIN
    limit = wm.drain if until_drain else wm.hold
    states = (Status.OPEN, Status.HOLD) if until_drain else (Status.OPEN,)
    ok = [
        v
        for v in views
        if model in v.node.models
        and v.state in states
        and v.projected() < limit
        and v.inflight < v.node.max_inflight
        and (until_drain or v.waiting < wm.max_engine_waiting)
    ]
    ok.sort(key=lambda v: (v.load(wm.hold), v.node.id))
    return ok


def fallbacks(nodes: list[NodeView], views: list[NodeView], model: str) -> list[tuple[str, str]]:
    """(node id, url) of where the edge goes when the chosen node refuses the connection: the
    next eligible nodes, then any other live node serving the model. A node that refuses
    connections has served nothing, so a held node beats a 502."""
    out = [v for v in nodes[1 : 1 + MAX_FALLBACKS]]
    if len(out) < MAX_FALLBACKS:
        taken = {v.node.id for v in nodes}
        live = sorted(
            (v for v in views if v.node.id not in taken and model in v.node.models
             and v.state in (Status.OPEN, Status.HOLD)),
            key=lambda v: v.projected(),
        )  # fmt: skip
        out += live[: MAX_FALLBACKS - len(out)]
    return [(v.node.id, v.node.url) for v in out]
