"""Tickets and node leases: the in-flight slots a request holds on a node, taken atomically in
Redis (lease.lua) so several sidecars never over-admit one node together.

A ticket is `<request id>:<node>:<tenant>`, so any sidecar process can take the release;
`:a` at the end marks a request answered ahead of its booking (ahead.py): its release, finding
nothing booked yet, leaves a mark so that the booking on its way books nothing.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any

from admission.policy import Node
from admission.scheduling.prefixes import NO_PREFIX, Prefix
from admission.store import Call, keys

log = logging.getLogger(__name__)

U = 1_000_000  # µs per second: lease TTLs are in Redis TIME units


# A request id: ours (16 hex digits) or the edge's (NGINX's $request_id, 32 hex digits).
REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")


def new_request_id() -> str:
    return secrets.token_hex(8)


def make_ticket(rid: str, node: str, tenant: str, ahead: bool = False) -> str:
    return f"{rid}:{node}:{tenant}:a" if ahead else f"{rid}:{node}:{tenant}"


def answered_ahead(ticket: str) -> bool:
    return ticket.endswith(":a")


def parse_ticket(ticket: str) -> tuple[str, str, str]:
    """(request id, node, tenant) of a ticket; ValueError if it is not one of ours."""
    parts = ticket.split(":")
    if len(parts) == 4 and parts[3] == "a":
        parts.pop()
    if len(parts) != 3 or not all(parts) or not REQUEST_ID.fullmatch(parts[0]):
        raise ValueError("malformed ticket")
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class Ask:
    """What one request would add to a node's ledger, and the limits its class must respect."""

    prompt_tokens: int  # pending prefill
    kv_tokens: int  # KV reserved until release: prompt estimate + output cap
    prefill_rate: float = 0.0  # the node's measured rate, tokens/s (0: unknown)
    prefill_budget: int = 0  # max pending prefill tokens after this one (0: not gated)
    kv_limit: int = -1  # max reserved KV tokens after this one (-1: not gated)
    urgent: bool = False  # the class admitted until drain: its KV builds the urgent reserve
    reserve_limit: int = -1  # other classes: their KV + this + the urgent reserve stay below
    urgent_waiting: int = 0  # urgent KV the caller has waiting for this node
    decode_limit_s: float = 0.0  # lower classes: the node's measured s/token must not be above
    # (0: no guard); checked by the sidecar only (routing.why_not), not sent to Redis
    prefix: Prefix = NO_PREFIX  # the prompt's head: lease.lua books what the node lacks of it
    pool_blocks: int = 0  # prefix blocks the node's KV pool keeps (0: unbounded)
    hit_tokens: int = 0  # prompt tokens this sidecar expects the node to have computed

    @property
    def prefill_tokens(self) -> int:
        """Pending prefill this request adds, as this sidecar guesses it (Redis decides)."""
        return max(0, self.prompt_tokens - self.hit_tokens)

    @property
    def new_kv(self) -> int:
        """KV this request adds to the node's booking, as this sidecar guesses it."""
        return max(0, self.kv_tokens - self.hit_tokens)


def take(node: Node, ticket: str, ttl_s: float, ask: Ask, force: bool = False) -> Call:
    """Take one in-flight lease on `node` and book `ask` in its ledger, if every limit holds
    (`force`: whatever they say: the request was sent there already)."""
    prefix = ask.prefix
    return Call(
        "lease",
        [
            keys.node_leases(node.id),
            keys.node_ledger(node.id),
            keys.node_gone(node.id),
            keys.node_prefixes(node.id),
        ],
        [
            node.max_inflight,
            int(ttl_s * U),
            ticket,
            ask.prompt_tokens,
            ask.kv_tokens,
            ask.prefill_rate,
            ask.prefill_budget,
            ask.kv_limit,
            int(ask.urgent),
            ask.reserve_limit,
            ask.urgent_waiting,
            int(force),
            prefix.block_tokens,
            ask.pool_blocks,
            *prefix.blocks,
        ],
    )


def give_back(
    ticket: str,
    released: bool = False,
    final: bool = False,
    ran: bool = True,
    confirmed: bool = True,
) -> Call:
    """Give a ticket's lease and its KV reservation back (idempotent: harmless if never taken).
    `released`: no booking of this ticket may follow — the request ended, or the round trip
    that carried its lease failed and the request will not run on this ticket's booking: a
    booking still on its way (Redis may run a command after its client timed out, and after
    this give-back sent on another connection) then books nothing. `final`: the same, and
    marked even when the lease was found — a lease granted to a request that was then refused,
    timed out or left: a copy of its round trip that Redis runs late (a round trip our late
    loop timed out and asked again: the first copy, on another connection, may run last) books
    nothing. Neither: the undo of a lease whose reply came while the request may still take
    that ticket. `ran` false with `released`: the request ended without reaching its engine
    (the node was unreachable): the prompt blocks its lease brought were never computed there.
    Only a release that may have run keeps them resident as computed. `confirmed` false with
    `released` and `ran`: the engine reported none of the prefix the lease was booked as
    holding cached: its blocks leave the node's resident set once nobody holds them."""
    _rid, node, _tenant = parse_ticket(ticket)
    return Call(
        "unlease",
        [
            keys.node_leases(node),
            keys.node_ledger(node),
            keys.node_gone(node),
            keys.node_prefixes(node),
        ],
        [ticket, b"2" if final else _released(ran, confirmed) if released else b"0"],
    )


def _released(ran: bool, confirmed: bool) -> bytes:
    return (b"1" if confirmed else b"4") if ran else b"3"


def given_back(ticket: str, result: Any) -> None:
    """Check an unlease.lua reply: a script error there (Redis being away raises instead) would
    leave the lease booked until its TTL, unseen — logged, so it is not."""
    if isinstance(result, Exception):
        log.error("giving back lease %s failed, left until its TTL: %s", ticket, result)


def granted(result: Any) -> bool:
    """Whether a lease.lua result says the lease was taken."""
    return isinstance(result, list) and bool(result) and int(result[0]) == 1


def figures(result: Any) -> tuple[int, float, int] | None:
    """(leases, pending prefill, reserved KV) on the node after a granted lease.lua result."""
    if not granted(result) or len(result) < 4:
        return None
    return int(result[1]), float(result[2]), int(result[3])


def over(result: Any) -> str:
    """The rule a forced lease went past ("" when none did, or not a granted result)."""
    return _text(result[4]) if granted(result) and len(result) >= 5 else ""


def hit_blocks(result: Any) -> int | None:
    """How many of the request's prefix blocks lease.lua found resident (None: no answer)."""
    if not isinstance(result, list) or len(result) < 6:
        return None
    return int(result[5])


def refusal(result: Any) -> tuple[str, float, int] | None:
    """(reason, pending prefill, reserved KV) of a refused lease.lua result; None if granted."""
    if granted(result) or not isinstance(result, list) or len(result) < 5:
        return None
    return _text(result[2]), float(result[3]), int(result[4])


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
