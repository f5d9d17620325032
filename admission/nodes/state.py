"""NodeState: what a node agent publishes and every sidecar reads — the one contract between them.

Written by `nodes.agent` as JSON under `keys.node_state(node)` with a TTL, read by the
dispatcher. Versioned: a reader refuses a version it does not know (the node reads as down,
and the log says why) rather than guess at fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

SCHEMA_VERSION = 1


class Status(StrEnum):
    """A node's admission state. The agent computes open/hold/drain/down; maintenance is an
    operator's flag applied by the sidecar."""

    OPEN = "open"  # below hold: every class is admitted
    HOLD = "hold"  # at or above hold: only classes admitted until drain
    DRAIN = "drain"  # at or above drain: nothing new; in-flight finish
    DOWN = "down"  # unhealthy, unreachable, or its agent is silent
    MAINTENANCE = "maintenance"  # drained by an operator (`admission node drain`)


@dataclass(frozen=True)
class NodeState:
    """One sample of one node. Memory figures are fractions of the node's GPU memory."""

    node: str
    seq: int
    state: Status
    source: str  # the memory source actually used (may fall back from the policy's choice)
    healthy: bool
    memory: float = 0.0  # the fraction the watermarks compared
    per_token: float = 0.0  # memory fraction one token of KV takes (0: unknown)
    base_memory: float = 0.0  # the fraction that is not KV in use (weights, activations, leaks)
    prefill_rate: float = 0.0  # prompt tokens/s the node clears at full load (0: not measured yet)
    tpot_s: float = 0.0  # seconds per output token the running requests see now (0: idle)
    # The same over the last seconds, steps weighed by their length (rates.Tpot; None:
    # an agent that predates it).
    decode_s: float | None = None
    kv_usage: float | None = None
    # The engine's KV pool in tokens (blocks × block size; None: unknown): how many prompt
    # prefix blocks it can keep computed, for the sidecars' prefix index. Optional, so readers
    # of this version that predate it ignore it.
    kv_pool_tokens: int | None = None
    prefix_hit_ratio: float | None = None  # prompt tokens found in the engine's prefix cache
    running: int = 0
    waiting: int = 0
    preemptions: float = 0.0
    gpu_used_bytes: int | None = None
    gpu_total_bytes: int | None = None
    error: str | None = None
    version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> NodeState:
        """Parse a published state; ValueError if it is not one this reader understands."""
        try:
            d: dict[str, Any] = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"node state is not JSON: {exc}") from exc
        if not isinstance(d, dict) or d.get("version") != SCHEMA_VERSION:
            raise ValueError(f"node state version {d.get('version')!r} is not {SCHEMA_VERSION}")
        known = {f.name for f in fields(cls)}
        try:
            d["state"] = Status(d["state"])
            return cls(**{k: v for k, v in d.items() if k in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"node state is malformed: {exc}") from exc

    @classmethod
    def down(cls, node: str, seq: int, source: str, error: str, healthy: bool = False) -> NodeState:
        return cls(
            node=node, seq=seq, state=Status.DOWN, source=source, healthy=healthy, error=error
        )
