"""What an edge's release says the engine did, and what the tenant is charged for it.

The log phase reports ticket, status and the engine's usage (admission/edge/release.lua); this
module turns one entry into the figures the dispatcher settles, or a BadRequest.
"""

from __future__ import annotations

from typing import Any

from admission.errors import BadRequest
from admission.policy import Policy
from admission.scheduling.leases import parse_ticket

RELEASE_KEYS = {"ticket", "status", "usage", "node_failed"}
# Statuses that mean no engine worked on the request: no upstream answered (0), NGINX could
# not connect (502), or the engine refused it (4xx: the request did not validate, 429/503: its
# queue was full). Not 499 (the client left; the engine may have generated meanwhile).
NOTHING_RAN = (0, 400, 404, 413, 422, 429, 502, 503)


def release_args(body: Any, policy: Policy) -> tuple[str, int, bool, int, int]:
    """(ticket, tokens charged, node unreachable, output tokens, cached prompt tokens; -1:
    unknown) or BadRequest. Cached prompt tokens cost the tenant's `cached_token_price`."""
    if not isinstance(body, dict):
        raise BadRequest("a release must be a JSON object", code="invalid_json")
    if unknown := sorted(set(body) - RELEASE_KEYS):
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}", code="unknown_field")
    ticket = body.get("ticket")
    try:
        if not isinstance(ticket, str):
            raise ValueError
        parse_ticket(ticket)
    except ValueError:
        raise BadRequest("ticket is missing or malformed", code="invalid_ticket") from None
    status = body.get("status", 200)
    if isinstance(status, bool) or not isinstance(status, int):
        raise BadRequest("status must be an integer")
    failed = body.get("node_failed", False)
    if not isinstance(failed, bool):
        raise BadRequest("node_failed must be true or false")
    usage = body.get("usage")
    if isinstance(usage, dict):
        p, c = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (p, c)):
            raise BadRequest(
                "usage.prompt_tokens and usage.completion_tokens must be integers >= 0"
            )
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens", -1) if isinstance(details, dict) else -1
        if isinstance(cached, bool) or not isinstance(cached, int) or cached > p:
            raise BadRequest(
                "usage.prompt_tokens_details.cached_tokens must be an integer <= prompt_tokens"
            )
        tenant = policy.tenants.get(parse_ticket(ticket)[2])
        price = tenant.limits.cached_token_price if tenant is not None else 1.0
        discount = 0 if cached < 0 else int(cached * (1.0 - price))
        return ticket, p + c - discount, failed, c, cached
    if usage is not None:
        raise BadRequest("usage must be an object or null")
    if status in NOTHING_RAN:
        return ticket, 0, failed, -1, -1  # no engine took it (connect refused, shed): nothing used
    # Unknown: keep the reservation as charged. That includes 500 and 504 without usage: the
    # engine may have generated up to the cap before it failed or the proxy timed out.
    return ticket, -1, failed, -1, -1
