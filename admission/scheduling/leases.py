"""Tickets and node leases: the in-flight slots a request holds on a node, taken atomically in
Redis (lease.lua) so several sidecars never over-admit one node together.

A ticket is `<request id>:<node>:<tenant>`, so any sidecar process can take the release.
"""

from __future__ import annotations

import secrets
from typing import Any

from admission.policy import Node
from admission.store import Call, keys

U = 1_000_000  # µs per second: lease TTLs are in Redis TIME units


def new_request_id() -> str:
    return secrets.token_hex(8)


def make_ticket(rid: str, node: str, tenant: str) -> str:
    return f"{rid}:{node}:{tenant}"


def parse_ticket(ticket: str) -> tuple[str, str, str]:
    """(request id, node, tenant) of a ticket; ValueError if it is not one of ours."""
    parts = ticket.split(":", 2)
    if len(parts) != 3 or not all(parts) or len(parts[0]) != 16:
        raise ValueError("malformed ticket")
    return parts[0], parts[1], parts[2]


def take(node: Node, ticket: str, ttl_s: float) -> Call:
    """Take one in-flight lease on `node` if it is under its cap."""
    return Call("lease", [keys.node_leases(node.id)], [node.max_inflight, int(ttl_s * U), ticket])


def give_back(ticket: str) -> Call:
    """The ZREM that gives a ticket's lease back (idempotent: harmless if never taken)."""
    _rid, node, _tenant = parse_ticket(ticket)
    return Call(None, [], ["ZREM", keys.node_leases(node), ticket])


def granted(result: Any) -> bool:
    """Whether a lease.lua result says the lease was taken."""
    return isinstance(result, list) and bool(result) and int(result[0]) == 1
