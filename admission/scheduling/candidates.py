"""Which nodes an admission examines: a bounded few, not the whole cluster. Pure.

Per model and pool, the nodes are kept ordered by how soon they clear the prefill booked on
them, then by how full their in-flight slots are, then by projected memory (nodes that take
nothing last; ties broken by a hash salted per sidecar, so that sidecars spread over equal
nodes rather than all asking the same one), re-sorted once per refresh when something moved.
An admission examines:
1. the nodes this sidecar believes hold its prompt's head (the prefix index), at most
   `PREFIX_NODES`, most blocks first;
2. the first `EXAMINE` nodes below their in-flight cap of each pool it may use
   (routing.pool_rank: its own, shared, lenders), and twice as many while fewer than `ENOUGH` of
   those examined would take it (the chosen node and the edge's fallbacks), looking at most
   `MAX_EXAMINE` deep per pool.
routing.eligible then judges these exactly as it judges a whole cluster. A model with at most
`EXAMINE` nodes in a pool has all of them examined: routing on 8 nodes is what it always was.

The bound's cost (docs/scaling.md): a node deeper than what was examined is skipped although
it would take the request only when its load fell since the last sort (≤ one refresh, 0.1 s
while requests flow) below that of `EXAMINE` others, or when the first `MAX_EXAMINE` all
refuse for a reason the order does not see (memory, decode); the request then waits in the
queue for the next pass.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import TypeVar

from admission.nodes.state import Status
from admission.scheduling.views import NodeView

EXAMINE = 8  # nodes per pool an admission examines first
ENOUGH = 3  # eligible nodes wanted: the chosen one and the edge's MAX_FALLBACKS
MAX_EXAMINE = 64  # nodes per pool at most, when the first ones refuse
PREFIX_NODES = 8  # nodes holding the prompt's head examined first
_TAKES = (Status.OPEN, Status.HOLD)

T = TypeVar("T")
Group = tuple[str, str | None]  # (model, pool: None for shared nodes)


class Candidates:
    """The per-(model, pool) orders, and the bounded pick from them."""

    def __init__(self, salt: str = "") -> None:
        self._salt = salt  # this sidecar's: ties broken differently on each sidecar
        self._tie: dict[str, int] = {}
        self._groups: dict[Group, list[NodeView]] = {}
        self._pools: dict[str, list[str | None]] = {}  # model → its pools, shared first
        self.by_model: dict[str, list[NodeView]] = {}
        self.stale = True  # something moved since the last sort

    def set_views(self, views: Iterable[NodeView]) -> None:
        self._groups, self.by_model, self._pools = {}, {}, {}
        for v in views:
            self._tie[v.node.id] = zlib.crc32(f"{self._salt}/{v.node.id}".encode())
            for m in v.node.models:
                self._groups.setdefault((m, v.node.pool), []).append(v)
                self.by_model.setdefault(m, []).append(v)
        for m, p in self._groups:
            self._pools.setdefault(m, []).append(p)
        for pools in self._pools.values():
            pools.sort(key=lambda p: (p is not None, p or ""))
        self.stale = True

    def sort(self, now: float) -> None:
        """Order every group by load as of `now` (only when something moved since)."""
        if not self.stale:
            return
        tie = self._tie
        for group in self._groups.values():
            group.sort(
                key=lambda v: (
                    v.state not in _TAKES,
                    v.wait_s(now),
                    v.inflight / max(1, v.node.max_inflight),
                    v.projected(),
                    tie[v.node.id],
                )
            )
        self.stale = False

    def pools(self, model: str) -> list[str | None]:
        return self._pools.get(model, [])

    def first(self, model: str, pool: str | None, n: int) -> list[NodeView]:
        return self._groups.get((model, pool), [])[:n]

    def pick(
        self,
        model: str,
        pools: list[str | None],
        held: list[NodeView],
        judge: Callable[[list[NodeView]], list[T]],
    ) -> list[T]:
        """`judge(views)` (routing.eligible) on the nodes holding the head (`held`), then the
        least loaded of each of `pools`, widened while fewer than ENOUGH pass, up to MAX_EXAMINE."""
        n = EXAMINE
        while True:
            seen = {id(v) for v in held}
            views = list(held)
            deeper = False
            for p in pools:
                group = self._groups.get((model, p), [])
                deeper = deeper or len(group) > n
                views += _first_with_room(group, n, seen)
            found = judge(views)
            if len(found) >= ENOUGH or not deeper or n >= MAX_EXAMINE:
                return found
            n = min(MAX_EXAMINE, n * 2)


def _first_with_room(group: list[NodeView], n: int, seen: set[int]) -> list[NodeView]:
    """The first `n` nodes of `group` below their in-flight cap (a full node, booked since the
    order was made, is skipped at the cost of one comparison, up to MAX_EXAMINE looked at)."""
    out = []
    for v in group[:MAX_EXAMINE]:
        if v.inflight < v.node.max_inflight and id(v) not in seen:
            out.append(v)
            if len(out) >= n:
                break
    return out


def prefix_nodes(hits: dict[str, int], views: dict[str, NodeView]) -> list[NodeView]:
    """The nodes holding most of the prompt's head, at most PREFIX_NODES."""
    best = sorted(hits.items(), key=lambda nb: -nb[1])[:PREFIX_NODES]
    return [v for n, _b in best if (v := views.get(n)) is not None]
