"""Every error the admission controller raises on purpose.

    AdmissionError                 base; carries the HTTP status and an OpenAI-shaped code
    ├── PolicyError                policies.yaml is invalid (every problem, with its path)
    ├── BadRequest                 the /admit or /release payload is malformed (400)
    ├── Throttled                  a tenant limit says no (429 + Retry-After)
    │   ├── QueueFull              the queue is at its bound (429 queue_full)
    │   ├── SloUnreachable         waiting longer cannot meet the class's TTFT target (429)
    │   └── OverFairShare          past capacity, a tenant over its weight's share (429)
    ├── RequestTooLarge            a cost no bucket can ever hold (400, do not retry)
    ├── QueueTimeout               waited past the class deadline (503 queue_timeout)
    └── BackendUnavailable         Redis down under fail-closed, or no node serves the model (503)

Third-party errors (redis-py, aiohttp) are translated into these at exactly one boundary each
(`admission.store` for Redis, `admission.server` for HTTP), with `raise ... from exc`.
"""

from __future__ import annotations

import math


class AdmissionError(Exception):
    """Base class: an error that maps to one HTTP answer."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, code: str = "internal_error") -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    retry_after: float | None = None  # seconds until retrying can help; None: it cannot
    # The tenant's buckets as this answer saw them (answer.ratelimit_headers), when known.
    ratelimit: dict[str, float] | None = None

    def retry_after_s(self) -> int | None:
        """The Retry-After header: whole seconds, rounded up and never 0 (clients would spin);
        None when retrying will not help."""
        if self.retry_after is None:
            return None
        return max(1, math.ceil(self.retry_after))


class PolicyError(AdmissionError):
    """policies.yaml (or its in-memory form) is invalid.

    `problems` lists every problem found, one line each, as ``path: message``; loading never
    stops at the first one, so an SRE fixes the whole file in one pass.
    """

    status = 500
    error_type = "policy_error"

    def __init__(self, problems: list[str]) -> None:
        super().__init__(
            f"{len(problems)} problem(s) in policy:\n" + "\n".join(problems), code="invalid_policy"
        )
        self.problems = problems


class BadRequest(AdmissionError):
    """The caller sent something malformed; nothing was queued or debited."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, code: str = "invalid_request") -> None:
        super().__init__(message, code=code)


class Unauthorized(AdmissionError):
    status = 401
    error_type = "authentication_error"


class Forbidden(AdmissionError):
    status = 403
    error_type = "permission_error"


class NotFound(AdmissionError):
    status = 404
    error_type = "invalid_request_error"


class PayloadTooLarge(AdmissionError):
    """A body over a configured byte bound (a Batch API file)."""

    status = 413
    error_type = "invalid_request_error"


class RequestTooLarge(AdmissionError):
    """The request costs more than a bucket can ever hold: retrying cannot succeed."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, limit: str, cost: int, capacity: int) -> None:
        super().__init__(
            f"request needs {cost} units of {limit} but the tenant's capacity is {capacity}",
            code="request_exceeds_limit",
        )
        self.limit = limit
        self.cost = cost
        self.capacity = capacity


class Throttled(AdmissionError):
    """A tenant limit denies the request now; it may succeed after `retry_after`."""

    status = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, reason: str, retry_after: float, message: str | None = None) -> None:
        super().__init__(message or f"rate limited: {reason}", code=reason)
        self.reason = reason
        self.retry_after = max(0.0, retry_after)


class QueueFull(Throttled):
    """The global or per-tenant queue bound is reached."""

    def __init__(self, scope: str, retry_after: float) -> None:
        super().__init__("queue_full", retry_after, f"queue is full ({scope})")
        self.scope = scope


class SloUnreachable(Throttled):
    """Waiting any longer cannot meet the class's TTFT target (`on_late: refuse`): refused now,
    with the time until the queue has drained enough, rather than served late."""

    def __init__(self, cls: str, retry_after: float) -> None:
        super().__init__(
            "slo_unreachable", retry_after, f"the {cls} class's TTFT target can no longer be met"
        )
        self.cls = cls


class OverFairShare(Throttled):
    """The class is past capacity (being refused late) and this tenant asks more than its
    weight's share of what it gets (scheduling/shedding.py): refused at arrival."""

    def __init__(self, cls: str, retry_after: float) -> None:
        super().__init__(
            "over_fair_share",
            retry_after,
            f"the {cls} class is past capacity and this tenant is over its weighted share",
        )
        self.cls = cls


class QueueTimeout(AdmissionError):
    """The request waited past its class deadline; its reserved tokens were refunded."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, waited_s: float, retry_after: float) -> None:
        super().__init__(
            f"no capacity within the class deadline (waited {waited_s:.1f}s)", code="queue_timeout"
        )
        self.waited_s = waited_s
        self.retry_after = retry_after


NO_CAPACITY_RETRY_S = 15.0  # a drain's or an outage's end is unknown: ask again after this


class NoCapacity(AdmissionError):
    """No node can take the model's requests now: every one is down, drained or in
    maintenance. Neither the tenant's limits nor overload: 503 `no_capacity`, never a 429 (the
    SDKs would report "rate limited" while the GPUs idle), Retry-After NO_CAPACITY_RETRY_S."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"no node can serve {model} now (down, drained or in maintenance)",
            code="no_capacity",
        )
        self.retry_after = NO_CAPACITY_RETRY_S


class BackendUnavailable(AdmissionError):
    """A dependency needed for the decision is down (Redis under fail-closed, no node)."""

    status = 503
    error_type = "service_unavailable"

    def __init__(
        self, message: str, *, code: str = "limiter_unavailable", retry_after: float = 1.0
    ):
        super().__init__(message, code=code)
        self.retry_after = retry_after
