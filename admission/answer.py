"""The admission answer, protocol-neutral: one JSON ask from the edge in, the decision out (or
an AdmissionError), and the one place Python builds the error body. The HTTP route
(`server.admit`) and the edge's own socket (`edge_socket`) are its two transports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from admission import status
from admission.errors import (
    AdmissionError,
    BadRequest,
    Forbidden,
    NoCapacity,
    NotFound,
    QueueTimeout,
    Throttled,
    Unauthorized,
)
from admission.limits import Limiter
from admission.metrics import Metrics
from admission.policy import Policy, Tenant
from admission.reload import PolicyHolder
from admission.scheduling import Dispatcher, prefixes
from admission.scheduling.ticket import REQUEST_ID

log = logging.getLogger(__name__)

MAX_TOKENS_LIMIT = 10_000_000
ADMIT_KEYS = {
    "tenant",
    "class",
    "model",
    "prompt_tokens",
    "max_tokens",
    "stream",
    "request_id",
    "arrived_at",
    "prefix",
    "prefix_chars",
    "ack",  # the edge acknowledges the answer on its socket (edge_socket)
    "reask",  # asked again after its first sidecar was lost
}


def _int_field(body: dict[str, Any], key: str, *, lo: int, default: int | None = None) -> int:
    v = body.get(key, default)
    if v is None and default is not None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"{key} must be an integer in [{lo}, {MAX_TOKENS_LIMIT}], got {v!r}")
    return v


def _tenant(policy: Policy, body: dict[str, Any]) -> Tenant:
    tid = body.get("tenant")
    if not isinstance(tid, str):
        raise BadRequest("tenant must be a string")
    tenant = policy.tenants.get(tid)
    if tenant is None:
        raise Unauthorized("unknown tenant", code="invalid_api_key")
    return tenant


# Refusals that empty a bucket (x-ratelimit-remaining-* 0 for them); every other refusal leaves
# the buckets as they are.
BUCKET_LIMITS = frozenset({"requests_per_s", "tokens_per_min", "burst"})


def error_body(exc: AdmissionError) -> dict[str, Any]:
    """OpenAI's error shape; Lua's edge/respond.lua writes the same for the edge's own."""
    return {"error": {"message": exc.message, "type": exc.error_type, "code": exc.code}}


def ratelimit_headers(rl: dict[str, float] | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers from `Limiter.headroom` (the same names the edge sets
    from an admission's `ratelimit`, edge/respond.lua)."""
    out: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        if rl and kind in rl:
            out[f"x-ratelimit-limit-{kind}"] = str(int(rl[kind]))
        if rl and f"{kind}_remaining" in rl:
            out[f"x-ratelimit-remaining-{kind}"] = str(int(rl[f"{kind}_remaining"]))
            out[f"x-ratelimit-reset-{kind}"] = duration(rl[f"{kind}_reset_s"])
    return out


def duration(s: float) -> str:
    """As OpenAI writes a reset: 20ms, 1.5s, 6m0s."""
    if s < 1:
        return f"{max(0, round(s * 1000))}ms"
    if s < 60:
        return f"{s:.1f}".rstrip("0").rstrip(".") + "s"
    return f"{int(s // 60)}m{int(s % 60)}s"


def loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", code="invalid_json") from exc


def json_object(raw: bytes, allowed: set[str]) -> dict[str, Any]:
    body = loads(raw)
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}", code="unknown_field")
    return body


@dataclass
class Decider:
    """What a decision needs: the running policy, the dispatcher and limiter, and where it is
    counted (metrics, the status page's recent decisions)."""

    holder: PolicyHolder
    metrics: Metrics
    dispatcher: Dispatcher
    limiter: Limiter
    recent: status.Recent

    async def decide(self, raw: bytes) -> dict[str, Any]:
        """One admission decision from the edge's JSON ask: the answer, or an AdmissionError (the
        HTTP route and the edge's own socket, admission.edge_socket, both answer with this)."""
        started = time.perf_counter()
        holder, metrics = self.holder, self.metrics
        policy = holder.current
        body = json_object(raw, ADMIT_KEYS)
        ask = _read(policy, body, self.dispatcher.nodes.serves)
        tenant, cls, model, rid = ask.tenant, ask.cls, ask.model, ask.rid
        dispatcher = self.dispatcher
        outcome, reason = "error", "internal"
        try:
            adm = await dispatcher.admit(
                tenant, cls, model, ask.prompt, ask.max_tokens, ask.waited_s, rid, ask.prefix
            )
            if body.get("reask") is True:  # its lost first sidecar may have leased a node for it
                await dispatcher.place.drop_stale(adm.ticket, model)
            outcome, reason = "admitted", "degraded" if self.limiter.degraded else "ok"
            return {
                "ratelimit": self.limiter.headroom(tenant),
                "ticket": adm.ticket,
                "node": adm.node,
                "url": adm.url,
                "fallbacks": [{"node": n, "url": u} for n, u in adm.fallbacks],
                "priority": adm.priority,
                "class": adm.cls,
                "queued_ms": round(adm.queued_s * 1000, 3),
            }
        except QueueTimeout:
            outcome, reason = "timeout", "queue_timeout"
            raise
        except Throttled as exc:
            outcome, reason = "throttled", exc.reason
            # Only a bucket's own refusal empties it in the headers; an overload refusal
            # (slo_unreachable, over_fair_share, queue_full) reports the buckets as they are.
            denied = exc.reason if exc.reason in BUCKET_LIMITS else ""
            exc.ratelimit = self.limiter.headroom(tenant, denied, exc.retry_after or 0.0)
            raise
        except asyncio.CancelledError:
            outcome, reason = "cancelled", "client_gone"
            raise
        except AdmissionError as exc:
            outcome, reason = "rejected", exc.code
            if isinstance(exc, NoCapacity):  # the buckets as they are: nothing was refused there
                exc.ratelimit = self.limiter.headroom(tenant)
            raise
        finally:
            metrics.decided(tenant.id, cls, outcome, reason, time.perf_counter() - started)
            dispatcher.demand.decided(model, outcome, reason)
            waited = adm.queued_s if outcome == "admitted" else 0.0
            self.recent.decided(tenant.id, cls, outcome, reason, waited, rid or "")
            if outcome not in ("admitted", "cancelled"):
                log.debug("request %s of %s (%s) %s: %s", rid, tenant.id, cls, outcome, reason)


@dataclass(frozen=True, slots=True)
class _Ask:
    """The edge's admission ask, checked against the policy."""

    tenant: Tenant
    cls: str
    model: str
    prompt: int
    max_tokens: int
    waited_s: float
    rid: str | None
    prefix: prefixes.Prefix


def _read(policy: Policy, body: dict[str, Any], serves: Callable[[str], bool]) -> _Ask:
    """The ask's fields, each checked (BadRequest, Forbidden, NotFound with the reason)."""
    tenant = _tenant(policy, body)
    cls = body.get("class") or tenant.default_class
    if not isinstance(cls, str) or cls not in tenant.classes:
        raise Forbidden(f"class {cls!r} is not allowed for this tenant", code="class_not_allowed")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model must be a non-empty string", code="invalid_model")
    if not serves(model):
        raise NotFound(f"model {model!r} does not exist", code="model_not_found")
    if tenant.models and model not in tenant.models:
        raise Forbidden(f"model {model!r} is not allowed for this tenant", code="model_not_allowed")
    prompt = _int_field(body, "prompt_tokens", lo=0, default=0)
    max_tokens = _int_field(body, "max_tokens", lo=1, default=policy.edge.default_max_tokens)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("stream must be true or false")
    waited_s = 0.0
    if (arrived := body.get("arrived_at")) is not None:
        if isinstance(arrived, bool) or not isinstance(arrived, (int, float)):
            raise BadRequest("arrived_at must be a number (seconds since the epoch)")
        # The edge and its sidecars share a host (unix sockets), so one clock. Bounded: a
        # skewed or forged value can neither jump the queue by more than the class deadline
        # nor make a request younger than now.
        waited_s = min(max(0.0, time.time() - arrived), policy.classes[cls].deadline_s)
    rid = body.get("request_id")
    if rid is not None and not (isinstance(rid, str) and REQUEST_ID.fullmatch(rid)):
        raise BadRequest("request_id must be 8 to 64 characters of [A-Za-z0-9_-]")
    try:
        prefix = prefixes.parse(
            body.get("prefix"), body.get("prefix_chars"), policy.edge.chars_per_token
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return _Ask(tenant, cls, model, prompt, max_tokens, waited_s, rid, prefix)


DECIDER = web.AppKey("decider", Decider)
