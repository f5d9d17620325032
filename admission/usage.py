"""What an edge's release says the engine did, and what the tenant is charged for it.

The log phase reports ticket, status and the engine's usage (admission/edge/release.lua); this
module turns one entry into the figures the dispatcher settles, or a BadRequest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from admission.errors import BadRequest
from admission.policy import Policy
from admission.scheduling.ticket import parse_ticket

log = logging.getLogger(__name__)

RELEASE_KEYS = {
    "ticket",
    "status",
    "usage",
    "node_failed",
    "header_s",
    "estimate",
    "model",
    "class",
    "finish",
}
MAX_UNKNOWN_LOGGED = 64  # unknown release field names logged once each (then no more)
_unknown_logged: set[str] = set()
MAX_NAME = 256  # characters of a release's model or class name
REFUSED_LOG_EVERY_S = 10.0
# Without usage, what the engine did is judged by evidence, not by the status alone:
# - no engine answered (status 0, or 502 with no response header: NGINX could not connect, or
#   the engine closed the connection unanswered): nothing ran, nothing is charged;
# - the engine refused it (4xx, 503: invalid, or its queue full) *quickly*: vLLM validates
#   before it schedules, in milliseconds, so an answer within REFUSED_WITHIN_S of the request
#   reaching it means nothing was generated. A slower 4xx may follow generation (vLLM validates
#   a `tool_choice: "required"` answer only after generating it, and answers 400 when it was
#   cut short): the reservation stays charged, as for 500, 504 and 499.
REFUSED = (400, 404, 413, 422, 429, 503)
REFUSED_WITHIN_S = 0.5


def _nothing_ran(status: int, header_s: float | None) -> bool:
    if status == 0 or (status == 502 and header_s is None):
        return True
    return status in REFUSED and header_s is not None and header_s <= REFUSED_WITHIN_S


def _usage(usage: dict[str, Any]) -> tuple[int, int, int] | None:
    """(prompt, completion, cached; -1: unknown) from the engine's usage, None when it is not
    usable (a field missing, null or negative): then the reservation stays charged."""
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (p, c)):
        return None
    assert isinstance(p, int) and isinstance(c, int)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", -1) if isinstance(details, dict) else -1
    if isinstance(cached, bool) or not isinstance(cached, int) or cached > p:
        return None
    return p, c, cached


@dataclass(frozen=True, slots=True)
class Release:
    """One release as the edge reports it, checked: what the tenant is charged and what the
    engine did."""

    ticket: str
    tokens: int  # to charge; -1: the reservation as booked
    node_failed: bool = False  # the node could not be reached
    output_tokens: int = -1  # the engine's completion_tokens (-1: unknown)
    cached_tokens: int = -1  # prompt tokens the engine found cached (-1: unknown)
    names: tuple[str, str] | None = None  # (model, class) as the edge read the request
    finish: str | None = "stop"  # how the answer ended (the engine's finish_reason)


def release_args(
    body: Any, policy: Policy, ratio: Callable[[float], None] = lambda _r: None
) -> Release:
    """The release `body` reports (tokens charged, node unreachable, output tokens, cached
    prompt tokens; -1: unknown) or BadRequest. Cached prompt tokens cost the tenant's
    `cached_token_price`.
    `ratio`: given the engine's prompt tokens over the edge's estimate of them (`estimate`, from
    `edge.chars_per_token`) when the release has both. Far from 1, the ledger books prompts,
    prefill and KV in the wrong size (the real node's tiny model: 3.2 tokens for 4 characters)."""
    if not isinstance(body, dict):
        raise BadRequest("a release must be a JSON object", code="invalid_json")
    # An edge newer than this sidecar: its releases still settle, their new fields unread
    # (refusing them held every lease to its TTL). Each field name is logged once.
    unknown = sorted(set(body) - RELEASE_KEYS - _unknown_logged)
    if unknown and len(_unknown_logged) < MAX_UNKNOWN_LOGGED:
        shown = [str(k)[:64] for k in unknown[:8]]
        _unknown_logged.update(str(k) for k in unknown)
        log.warning("releases carry field(s) this sidecar ignores: %s", ", ".join(shown))
    ticket = body.get("ticket")
    try:
        if not isinstance(ticket, str):
            raise ValueError
        parse_ticket(ticket)
    except ValueError:
        raise BadRequest("ticket is missing or malformed", code="invalid_ticket") from None
    status, failed, header_s, estimate = _release_fields(body)
    told = release_names(body), release_finish(body)
    usage = body.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise BadRequest("usage must be an object or null")
    read = _usage(usage) if usage is not None else None
    if usage is not None and read is None:
        log.warning("release %s: unreadable usage %.200s; charged as booked", ticket, usage)
    if read is not None:
        p, c, cached = read
        if estimate and p:
            ratio(p / estimate)
        tenant = policy.tenants.get(parse_ticket(ticket)[2])
        price = tenant.limits.cached_token_price if tenant is not None else 1.0
        discount = 0 if cached < 0 else int(cached * (1.0 - price))
        return Release(ticket, p + c - discount, failed, c, cached, *told)
    if usage is None and _nothing_ran(status, header_s):
        # No engine took it (connection refused, shed): nothing used.
        return Release(ticket, 0, failed, -1, -1, *told)
    # Unknown: keep the reservation as charged. That includes 500 and 504 without usage (the
    # engine may have generated up to the cap before it failed or the proxy timed out), and
    # usage that cannot be read (the lease still goes back: a bad field loses nothing).
    return Release(ticket, -1, failed, -1, -1, *told)


def _release_fields(body: dict[str, Any]) -> tuple[int, bool, Any, int | None]:
    """A release's status, node_failed, header_s and estimate, each checked (BadRequest), and
    its model and class names checked."""
    status = body.get("status", 200)
    if isinstance(status, bool) or not isinstance(status, int):
        raise BadRequest("status must be an integer")
    failed = body.get("node_failed", False)
    if not isinstance(failed, bool):
        raise BadRequest("node_failed must be true or false")
    header_s = body.get("header_s")
    number = isinstance(header_s, int | float) and not isinstance(header_s, bool)
    if header_s is not None and not number:
        raise BadRequest("header_s must be a number or null")
    estimate = body.get("estimate")
    if estimate is not None and (
        isinstance(estimate, bool) or not isinstance(estimate, int) or estimate < 0
    ):
        raise BadRequest("estimate must be a non-negative integer or null")
    for key in ("model", "class"):
        name = body.get(key)
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME):
            raise BadRequest(f"{key} must be a string of 1 to {MAX_NAME} characters, or null")
    return status, failed, header_s, estimate


def release_finish(body: dict[str, Any]) -> str | None:
    """How the engine ended the answer (its finish_reason, as the edge read it: "stop",
    "length", ...), or None when the edge did not say: only an answer that ended on its own
    teaches what the tenant's answers run to (scheduling/answer_lengths.py)."""
    finish = body.get("finish")
    return finish if isinstance(finish, str) and 0 < len(finish) <= 32 else None


def release_names(body: dict[str, Any]) -> tuple[str, str] | None:
    """The (model, class) a release names (the request as the edge read it), or None: a sidecar
    learns from them what the tenant's answers run to when another sidecar admitted it.
    Only after `release_args` accepted the body."""
    model, cls = body.get("model"), body.get("class")
    return (model, cls) if isinstance(model, str) and isinstance(cls, str) else None


class RefusedReleases:
    """Entries of an edge's release batch refused as malformed, logged at most once every
    REFUSED_LOG_EVERY_S with how many since. The edge takes the batch's 200 as delivered: such
    a lease waits out its TTL, charged as booked. An edge newer than its sidecars (fields
    they do not know) refuses every release: one line, not one per release."""

    def __init__(self) -> None:
        self._logged_at = -1e18
        self._since = 0

    def note(self, exc: BadRequest) -> None:
        self._since += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSED_LOG_EVERY_S:
            log.warning(
                "%d release(s) refused since the last such line, the last (%s): %s; their "
                "leases wait out their TTL",
                self._since,
                exc.code,
                exc.message,
            )
            self._logged_at, self._since = now, 0
