"""The per-node gauges a sidecar exports, set only for the nodes a refresh read or changed."""

from __future__ import annotations

from typing import Any

from admission.metrics import Metrics
from admission.nodes.state import Status
from admission.scheduling.views import NodeView


class NodeGauges:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._kids: dict[str, Any] = {}  # node → its gauges' children (labels() costs)
        self._said: dict[str, tuple[Any, ...]] = {}  # node → what its gauges say now

    def set(self, views: list[NodeView]) -> None:
        """Set the gauges of `views` (the others' did not move)."""
        m = self.metrics
        for v in views:
            nid = v.node.id
            kids = self._kids.get(nid)
            if kids is None:
                states = tuple((s, m.node_state.labels(nid, s.value)) for s in Status)
                kids = self._kids[nid] = (
                    states,
                    m.node_memory.labels(nid),
                    m.node_inflight.labels(nid),
                    m.node_prefix_hits.labels(nid),
                )
            states, memory, inflight, hits = kids
            now = (v.state, round(v.projected(), 4), v.inflight, v.prefix_hit_ratio)
            if self._said.get(nid) == now:
                continue
            self._said[nid] = now
            for s, g in states:
                g.set(1 if v.state == s else 0)
            memory.set(now[1])
            inflight.set(v.inflight)
            if v.prefix_hit_ratio is not None:
                hits.set(v.prefix_hit_ratio)
