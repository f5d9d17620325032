"""The node change feed: one Redis stream that says what changed about which node.

A sidecar reads it with every refresh — one XRANGE however many nodes there are — instead of
re-reading every node's keys, and re-reads the keys of a few nodes per refresh in turn (the
safety net: what the feed missed is corrected within `nodes / SWEEP` refreshes). Written by:
- agents (`Publisher`): kind "s" with the NodeState JSON when a node's state moved (status,
  health, or a figure past its dead band), kind "h" (alive, unchanged) otherwise once every
  `HEARTBEAT_SHARE` of `stale_after_s` — a node whose agent goes silent reads as down on every
  sidecar when its last word is `stale_after_s` old, as its state key expires in Redis;
- sidecars: kind "a" when an operator drains a node or clears it (v = "drain" or ""), kind "e"
  when proxied requests eject it (v = milliseconds it stays out).

Entry ids are Redis's clock (ms), so "how old" is measured by one clock for every writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from admission.nodes.state import NodeState
from admission.store import keys

FEED_LEN = 50_000  # entries kept (trimmed approximately): ~10 s of 1,024 busy nodes
HEARTBEAT_SHARE = 1 / 3  # an unchanged node's agent says it is alive this often (× stale_after_s)
MEMORY_BAND = 0.002  # memory fraction moves smaller than this are not news
RATE_BAND = 0.05  # relative moves of per-token memory, prefill rate and TPOT smaller than this


def _near(a: float, b: float, band: float) -> bool:
    return math.isclose(a, b, rel_tol=band, abs_tol=1e-9)


def moved(old: NodeState, new: NodeState) -> bool:
    """Whether `new` is news to sidecars that know `old`: anything they decide on moved."""
    if (old.state, old.healthy, old.error, old.source) != (
        new.state,
        new.healthy,
        new.error,
        new.source,
    ) or old.kv_pool_tokens != new.kv_pool_tokens:
        return True
    if abs(old.memory - new.memory) >= MEMORY_BAND:
        return True
    if abs(old.base_memory - new.base_memory) >= MEMORY_BAND:
        return True
    return not (
        _near(old.per_token, new.per_token, RATE_BAND)
        and _near(old.prefill_rate, new.prefill_rate, RATE_BAND)
        and _near(old.tpot_s, new.tpot_s, RATE_BAND)
        and _near(old.decode_s or 0.0, new.decode_s or 0.0, RATE_BAND)
        and _near(old.prefix_hit_ratio or 0.0, new.prefix_hit_ratio or 0.0, RATE_BAND)
    )


def entry(node: str, kind: str, value: str = "") -> dict[str, str]:
    return {"n": node, "k": kind, "v": value}


def add(pipe: Any, node: str, kind: str, value: str = "") -> None:
    pipe.xadd(keys.node_changes(), entry(node, kind, value), maxlen=FEED_LEN, approximate=True)


class Publisher:
    """An agent's side: each sample's state key (with its TTL, as ever) and what is news."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[NodeState, float]] = {}  # node → last state told, when

    def publish(self, pipe: Any, states: list[NodeState], now: float, stale_after_s: float) -> int:
        """Queue the writes for `states` on `pipe`; return how many feed entries they add."""
        ttl_ms = int(stale_after_s * 1000)
        told = 0
        for st in states:
            pipe.set(keys.node_state(st.node), st.to_json(), px=ttl_ms)
            last = self._sent.get(st.node)
            if last is None or moved(last[0], st):
                add(pipe, st.node, "s", st.to_json())
                self._sent[st.node] = (st, now)
                told += 1
            elif now - last[1] >= stale_after_s * HEARTBEAT_SHARE:
                add(pipe, st.node, "h")
                self._sent[st.node] = (last[0], now)
                told += 1
        return told


@dataclass
class Changes:
    """What a read of the feed said, per node (the last entry of each kind wins)."""

    last_id: bytes | None = None
    count: int = 0
    states: dict[str, bytes] = field(default_factory=dict)  # node → NodeState JSON
    heard_ms: dict[str, int] = field(default_factory=dict)  # node → its agent's last word (ms)
    admin: dict[str, bool] = field(default_factory=dict)  # node → drained by an operator
    ejected_ms: dict[str, int] = field(default_factory=dict)  # node → until (Redis ms; 0 none)


def after(last_id: bytes | str) -> str:
    """XRANGE's start for the entries after `last_id` (exclusive). XRANGE, not XREAD: its key
    sits where a Cluster client finds it, while XREAD's keys make redis-py ask a node which
    they are (COMMAND GETKEYS) — one more round trip per refresh."""
    return "(" + (last_id.decode() if isinstance(last_id, bytes) else last_id)


def parse(reply: Any) -> Changes:
    """An XRANGE reply on the feed → Changes (unknown kinds are skipped: a newer writer)."""
    ch = Changes()
    for entry_id, f in reply or []:
        ch.last_id = entry_id
        ch.count += 1
        node = f.get(b"n", b"").decode()
        kind, value = f.get(b"k", b""), f.get(b"v", b"")
        ms = int(entry_id.split(b"-", 1)[0])
        if kind in (b"s", b"h"):
            ch.heard_ms[node] = ms
            if kind == b"s":
                ch.states[node] = value
        elif kind == b"a":
            ch.admin[node] = value == b"drain"
        elif kind == b"e":
            ch.ejected_ms[node] = ms + int(value) if value.isdigit() else 0
    return ch
