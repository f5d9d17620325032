"""Node leases: the in-flight slots a request holds on a node, taken atomically in Redis
(lease.lua) so several sidecars never over-admit one node together. What a request asks of a
node is `ask.Ask`; the lease's name is its `ticket.Ticket`.
"""

from __future__ import annotations

import logging
from typing import Any

from admission.policy import Node
from admission.scheduling.ask import Ask
from admission.scheduling.ticket import parse_ticket
from admission.store import Call, keys

log = logging.getLogger(__name__)

U = 1_000_000  # µs per second: lease TTLs are in Redis TIME units


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
