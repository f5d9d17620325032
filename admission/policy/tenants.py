"""`tenants:` of policies.yaml: each tenant's tier, weight, API keys (digests), classes,
models and limits, checked into `Tenant`s (part of admission.policy.load)."""

from __future__ import annotations

import logging
from typing import Any

from admission.policy.checks import Checker, is_id
from admission.policy.model import ClassPolicy, Limits, Tenant, digest_key

log = logging.getLogger("admission.policy.load")


_TENANT_KEYS = {
    "tier",
    "weight",
    "keys",
    "classes",
    "default_class",
    "limits",
    "models",
    "shadow",
    "cache_group",
}
_LIMIT_KEYS = set(Limits.__dataclass_fields__)


def tenants(
    c: Checker,
    raw: Any,
    tiers: dict[str, float],
    classes: dict[str, ClassPolicy],
    shadow: bool = False,
) -> dict[str, Tenant]:
    m = c.mapping(raw, "tenants", None)
    if m is None:
        return {}
    out: dict[str, Tenant] = {}
    for tid, body in m.items():
        p = f"tenants.{tid}"
        if not is_id(tid):
            c.err(p, "tenant id must be letters, digits, '-', '_' or '.'")
        b = c.mapping(body, p, _TENANT_KEYS, required={"keys", "limits"}) or {}
        tier = c.string(b, "tier", p, "default")
        if "weight" in b:
            weight = c.number(b, "weight", p, 1.0, lo=0, lo_open=True)
        elif tier in tiers:
            weight = tiers[tier]
        else:
            if "tier" in b:
                c.err(f"{p}.tier", f"unknown tier {tier!r} (define it under tiers: or set weight)")
            weight = 1.0
        digests, demo = _keys(c, b.get("keys"), f"{p}.keys")
        allowed = tuple(c.string_list(b, "classes", p, list(classes)))
        for i, k in enumerate(allowed):
            if k not in classes:
                c.err(f"{p}.classes[{i}]", f"unknown class {k!r}")
        default = c.string(b, "default_class", p, allowed[0] if allowed else "")
        if allowed and default not in allowed:
            c.err(
                f"{p}.default_class", f"{default!r} is not in the tenant's classes {list(allowed)}"
            )
        out[str(tid)] = Tenant(
            id=str(tid),
            tier=tier,
            weight=weight,
            key_digests=digests,
            classes=allowed,
            default_class=default,
            limits=_limits(c, b.get("limits"), f"{p}.limits"),
            models=tuple(c.string_list(b, "models", p, [])),
            demo_keys=demo,
            shadow=c.boolean(b, "shadow", p, shadow),
            cache_group=_cache_group(c, b, p),
        )
    return out


def _cache_group(c: Checker, b: dict[str, Any], p: str) -> str | None:
    if "cache_group" not in b:
        return None
    group = c.string(b, "cache_group", p, "")
    if not is_id(group):
        c.err(f"{p}.cache_group", "must be letters, digits, '-', '_' or '.'")
        return None
    return group


def _keys(c: Checker, raw: Any, p: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(raw, list) or not raw:
        c.err(p, "must be a non-empty list of 'sha256:<hex digest>' or 'plain:<demo key>'")
        return (), ()
    digests: list[str] = []
    demo: list[str] = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item.startswith("sha256:"):
            d = item[7:].lower()
            if len(d) != 64 or any(ch not in "0123456789abcdef" for ch in d):
                c.err(f"{p}[{i}]", "sha256 digest must be 64 hex characters")
                continue
            digests.append(d)
        elif isinstance(item, str) and item.startswith("plain:") and len(item) > 6:
            # Never echo the key itself in an error or log line.
            demo.append(item[6:])
            digests.append(digest_key(item[6:]))
        else:
            c.err(f"{p}[{i}]", "must be 'sha256:<hex digest>' or 'plain:<demo key>'")
    for i, d in enumerate(digests):
        if d in digests[:i]:
            c.err(f"{p}[{i}]", "duplicate key")
    return tuple(digests), tuple(demo)


def _limits(c: Checker, raw: Any, p: str) -> Limits:
    req = {"requests_per_s", "tokens_per_min"}
    b = c.mapping(raw, p, _LIMIT_KEYS, required=req) or {}
    rps = c.number(b, "requests_per_s", p, 1.0, lo=0, lo_open=True)
    tpm = c.number(b, "tokens_per_min", p, 1.0, lo=0, lo_open=True)
    lim = Limits(
        requests_per_s=rps,
        request_burst=c.integer(b, "request_burst", p, max(1, int(rps)), lo=1),
        tokens_per_min=tpm,
        token_burst=c.integer(b, "token_burst", p, max(1, int(tpm)), lo=1),
        burst_window_s=c.number(b, "burst_window_s", p, 1.0, lo=0.001),
        burst_max=c.integer(b, "burst_max", p, 0, lo=0),
        max_concurrent=c.integer(b, "max_concurrent", p, 0, lo=0),
        max_queued=c.integer(b, "max_queued", p, 0, lo=0),
        cached_token_price=c.number(b, "cached_token_price", p, 1.0, lo=0, hi=1),
    )
    # Integer micro-unit arithmetic in the Redis script stays exact below 2**53.
    if lim.token_burst > 10**9:
        c.err(f"{p}.token_burst", f"must be <= 1e9, got {lim.token_burst}")
    if rps > 10**6 or tpm > 10**9:
        c.err(p, "rates above 1e6 requests/s or 1e9 tokens/min are not supported")
    return lim
