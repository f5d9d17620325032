"""A request's ticket: the name of its node lease and of its reservation, which crosses
processes as a string (the sidecar's answer, the edge's release, Redis's lease sets).

`<request id>:<node>:<tenant>`, so any sidecar process can take the release; `:a` at the end
marks a request answered ahead of its booking (answer_ahead.py): its release, finding nothing booked
yet, leaves a mark so that the booking on its way books nothing. Pure.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

# A request id: ours (16 hex digits) or the edge's (NGINX's $request_id, 32 hex digits).
REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")


def new_request_id() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Ticket:
    rid: str
    node: str
    tenant: str
    ahead: bool = False  # answered before its booking

    def to_str(self) -> str:
        base = f"{self.rid}:{self.node}:{self.tenant}"
        return f"{base}:a" if self.ahead else base

    @classmethod
    def parse(cls, ticket: str) -> Ticket:
        """The ticket a string names; ValueError if it is not one of ours."""
        parts = ticket.split(":")
        ahead = len(parts) == 4 and parts[3] == "a"
        if ahead:
            parts.pop()
        if len(parts) != 3 or not all(parts) or not REQUEST_ID.fullmatch(parts[0]):
            raise ValueError("malformed ticket")
        return cls(parts[0], parts[1], parts[2], ahead)


def make_ticket(rid: str, node: str, tenant: str, ahead: bool = False) -> str:
    return Ticket(rid, node, tenant, ahead).to_str()


def parse_ticket(ticket: str) -> tuple[str, str, str]:
    """(request id, node, tenant) of a ticket; ValueError if it is not one of ours."""
    t = Ticket.parse(ticket)
    return t.rid, t.node, t.tenant


def answered_ahead(ticket: str) -> bool:
    return ticket.endswith(":a")
