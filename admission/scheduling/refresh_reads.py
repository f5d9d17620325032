"""How a sidecar keeps its node views current: the change feed, and a few nodes re-read in turn.

One refresh is one pipeline of a bounded size, whatever the cluster's:
- the change feed since the last refresh (nodes/feed.py: one XRANGE): states that moved, agents
  still alive, operators' drains, ejections;
- every key of `SWEEP` nodes in turn (state and its TTL, admin flag, ejection, lease count,
  ledger): the safety net for what the feed did not say, and the other sidecars' bookings;
- the ledger of the nodes this sidecar booked on or released since (at most `TOUCHED`).
The first refresh reads every node (a full resync), and takes the feed on from a little before
its newest entry: the reads of one pipeline run in any order on a Cluster's masters, so a state
key read before an agent's write can sit beside a feed read after that write's entry (a drain
seen only by the sweep, 14 s late under load). After a failed refresh the feed is read on from
where the last good one ended, its oldest entry beside it: only if the feed no longer reaches
back there (trimmed, or Redis restarted empty) is the next refresh a full one. A full resync
after every failure (3,072 commands on 512 nodes, 2–4 s under load, and failing again) kept an
overloaded sidecar's views 10 s and more behind.

Lease counts and ledgers stay authoritative in Redis (lease.lua decides every lease); between
reads a view advances by this sidecar's bookings and the figures its lease replies carry, so a
stale view costs a refused lease (and a retry on the next node), never a wrong booking. A node
whose agent's last word is `stale_after_s` old reads as down, as its state key expires.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from admission.nodes import feed
from admission.nodes.state import NodeState, Status
from admission.scheduling.views import RESERVE_HALF_S, NodeView
from admission.store import keys

log = logging.getLogger(__name__)

SWEEP = 16  # nodes whose every key one refresh re-reads (each node in turn)
TOUCHED = 32  # nodes whose ledger one refresh re-reads because this sidecar used them
CHECK_EVERY_S = 0.25  # silent agents and ended ejections looked for this often (all nodes)
CHANGES_READ = 20_000  # feed entries one refresh reads at most (more: the next one goes on)
_FULL = 6  # commands per node fully read
_LEDGER = 2  # ... and per ledger read
RESYNC_OVERLAP_S = 1.0  # a full resync takes the feed on from its newest entry − this − its time


@dataclass
class Plan:
    """What one refresh asked: the feed (or, `full`, its newest id), then `swept` nodes' every
    key, then `ledgers`' ledgers."""

    full: bool
    swept: list[NodeView]
    ledgers: list[NodeView]
    started: float  # when the refresh began (local clock)
    check: bool  # the feed's oldest entry asked, after the feed (a refresh had failed)

    @property
    def commands(self) -> int:
        return 1 + self.check + _FULL * len(self.swept) + _LEDGER * len(self.ledgers)


class NodeReads:
    """What one sidecar knows of the nodes between reads, and the reads of one refresh."""

    def __init__(self, stale_after_s: Callable[[], float]) -> None:
        self.stale_after_s = stale_after_s
        self.full = True  # read every node next time
        self.lost = False  # a refresh failed since the last good one (its feed read was lost)
        self._feed_id: bytes | str = "0-0"  # where the next feed read starts (exclusive)
        self._seen: tuple[int, int] | None = None  # the newest entry read (a full one: asked)
        self._at = 0  # the sweep's position
        self._touched: dict[str, None] = {}
        self.last: dict[str, NodeState | None] = {}  # node → its agent's last state
        self.alive_until: dict[str, float] = {}  # node → when its agent's last word is stale
        self.ejected_until: dict[str, float] = {}
        self.admin: set[str] = set()
        self._bad_state_logged: set[str] = set()
        self.moved = False  # a state or a ledger read differed from the view (the order moves)
        self._checked_at = -1e9

    def touch(self, node: str) -> None:
        if len(self._touched) < TOUCHED:
            self._touched[node] = None

    def queue(self, pipe: Any, views: list[NodeView], started: float) -> Plan:
        """Queue this refresh's reads on `pipe` (after its TIME), begun at `started`; what
        `apply` needs of them."""
        full = self.full
        if full:
            swept = views
            pipe.xrevrange(keys.node_changes(), count=1)
        else:
            n = min(SWEEP, len(views))
            self._at %= max(1, len(views))
            swept = (views[self._at :] + views[: self._at])[:n]
            self._at += n
            pipe.xrange(keys.node_changes(), feed.after(self._feed_id), "+", count=CHANGES_READ)
            if self.lost:
                pipe.xrange(keys.node_changes(), "-", "+", count=1)
        names = {v.node.id for v in swept}
        by_id = {v.node.id: v for v in views} if self._touched else {}
        ledgers = [by_id[n] for n in self._touched if n not in names and n in by_id]
        self._touched = {}
        for v in swept:
            nid = v.node.id
            pipe.get(keys.node_state(nid))
            pipe.pttl(keys.node_state(nid))
            pipe.get(keys.node_admin(nid))
            pipe.pttl(keys.node_eject(nid))
            self._ledger(pipe, nid)
        for v in ledgers:
            self._ledger(pipe, v.node.id)
        return Plan(full, swept, ledgers, started, self.lost and not full)

    @staticmethod
    def _ledger(pipe: Any, nid: str) -> None:
        pipe.zcard(keys.node_leases(nid))
        pipe.hmget(keys.node_ledger(nid), "p", "t", "kv", "u", "r", "rt", "s")

    def apply(
        self, plan: Plan, res: list[Any], redis_us: int, now: float, views: dict[str, NodeView]
    ) -> set[str]:
        """Take the replies to `plan` (`res`, after TIME); return the nodes whose state must be
        observed again (what changed, and what was read)."""
        full, swept, ledgers = plan.full, plan.swept, plan.ledgers
        self.full = self.lost = False
        offset = now - redis_us / 1e6  # local clock − Redis's
        dirty: set[str] = set()
        if full:
            newest = res[0]
            if newest:  # what was written while the keys were read is read again (harmless:
                self._seen = _order(newest[0][0])  # a node's last entry is its newest)
                back_ms = int((now - plan.started + RESYNC_OVERLAP_S) * 1000)
                self._feed_id = f"{max(0, self._seen[0] - back_ms)}-0"
        else:
            self._take_feed(plan, res, offset, views, dirty)
        i = 1 + plan.check
        for v in swept:
            nid = v.node.id
            raw, ttl, admin, eject = res[i : i + 4]
            self.last[nid] = self._state(nid, raw)
            # No TTL (-1): written by hand, never stale; gone (-2) or no state: down.
            alive = now + ttl / 1000 if ttl >= 0 else (math.inf if ttl == -1 else 0.0)
            self.alive_until[nid] = alive if raw is not None else 0.0
            (self.admin.add if admin else self.admin.discard)(nid)
            self.ejected_until[nid] = now + eject / 1000 if eject > 0 else 0.0
            self._take_ledger(v, res[i + 4], res[i + 5], redis_us, now)
            dirty.add(nid)
            i += _FULL
        for v in ledgers:
            self._take_ledger(v, res[i], res[i + 1], redis_us, now)
            dirty.add(v.node.id)
            i += _LEDGER
        if now - self._checked_at < CHECK_EVERY_S:
            return dirty
        self._checked_at = now
        for nid, v in views.items():  # agents gone silent, ejections over: no entry says so
            ej = self.ejected_until.get(nid, 0.0)
            if ej and ej <= now:
                self.ejected_until[nid] = 0.0
                dirty.add(nid)
            elif v.state != Status.DOWN and self.alive_until.get(nid, 0.0) <= now:
                dirty.add(nid)
        return dirty

    def _take_feed(
        self,
        plan: Plan,
        res: list[Any],
        offset: float,
        views: dict[str, NodeView],
        dirty: set[str],
    ) -> None:
        """Take the change feed's news since the last read into the states, adding the nodes it
        names to `dirty`. `offset`: the local clock − Redis's."""
        stale_s = self.stale_after_s()
        if plan.check:  # the feed still reaches back to where the last good read ended?
            oldest = res[1]
            self.full = not oldest or self._seen is None or _order(oldest[0][0]) > self._seen
        ch = feed.parse(res[0])
        if ch.last_id is not None:
            self._feed_id, self._seen = ch.last_id, _order(ch.last_id)
        for node, raw in ch.states.items():
            self.last[node] = self._state(node, raw)
        for node, ms in ch.heard_ms.items():
            self.alive_until[node] = ms / 1000 + offset + stale_s
            v = views.get(node)
            if v is not None and v.state == Status.DOWN and self.last.get(node):
                dirty.add(node)  # heard again: back in its last state
        self.admin.update(n for n, on in ch.admin.items() if on)
        self.admin.difference_update(n for n, on in ch.admin.items() if not on)
        for node, ms in ch.ejected_ms.items():
            self.ejected_until[node] = ms / 1000 + offset if ms else 0.0
        # (not a node the policy no longer has, whose agent still publishes)
        dirty.update(n for n in (*ch.states, *ch.admin, *ch.ejected_ms) if n in views)
        self.moved = self.moved or bool(ch.states)

    def why(self, nid: str, now: float) -> str:
        """The cause of a node's state as this sidecar sees it, for its log line ("" when its
        agent's state says it all)."""
        if self.ejected_until.get(nid, 0.0) > now:
            return " (ejected: the edge could not reach it)"
        if self.alive_until.get(nid, 0.0) <= now:
            return " (its agent's state is stale: the agent stopped or cannot reach Redis)"
        if nid in self.admin:
            return " (operator maintenance)"
        return ""

    def state_of(self, nid: str, now: float) -> NodeState | None:
        """The state a node is observed in (None: down — silent, unreadable or ejected)."""
        if self.alive_until.get(nid, 0.0) <= now or self.ejected_until.get(nid, 0.0) > now:
            return None
        return self.last.get(nid)

    def _take_ledger(
        self, v: NodeView, leases: Any, ledger: Any, redis_us: int, now: float
    ) -> None:
        p, t, kv, u, r, rt, sh = ledger
        pending = float(p or 0)
        if t is not None and v.prefill_rate > 0:  # drained until Redis's now
            pending = max(0.0, pending - v.prefill_rate * (redis_us - int(t)) / 1e6)
        reserve = float(r or 0)
        if rt is not None:  # decayed until Redis's now, as lease.lua does
            reserve *= 0.5 ** (max(0, redis_us - int(rt)) / 1e6 / RESERVE_HALF_S)
        before = (v.inflight, v.kv_reserved, v.kv_urgent, round(v.pending_now(now)))
        v.ledger(pending, int(kv or 0), int(leases), now, int(u or 0), reserve, int(sh or 0))
        if not self.moved and before != (v.inflight, v.kv_reserved, v.kv_urgent, round(pending)):
            self.moved = True

    def _state(self, node: str, raw: bytes | None) -> NodeState | None:
        if raw is None:
            return None
        try:
            return NodeState.from_json(raw)
        except ValueError as exc:
            if node not in self._bad_state_logged:  # once per node: it would repeat
                self._bad_state_logged.add(node)
                log.error(
                    "node %s: unreadable state from its agent, treated as down: %s", node, exc
                )
            return None


def _order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") in the stream's order."""
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)
