"""Loading policies.yaml: every problem collected (dotted path, YAML line) into one PolicyError.

Nothing half-valid ever reaches the running service: `parse_policy` either returns a complete
`Policy` or raises with the whole list, so an SRE fixes a file in one pass.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from pathlib import Path
from typing import Any

import yaml

from admission.errors import PolicyError
from admission.policy.checks import Checker, duplicate_keys, line_map, shown
from admission.policy.model import (
    AdmitUntil,
    ClassPolicy,
    EdgeSettings,
    OnLate,
    Policy,
    QueueSettings,
    RedisSettings,
    Watermarks,
)
from admission.policy.nodes import parse_discovery, parse_nodes
from admission.policy.pools import parse_batch, parse_pools
from admission.policy.removed import removed as _removed
from admission.policy.tenants import tenants as _tenants

log = logging.getLogger(__name__)


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policies.yaml file; raise PolicyError listing every problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([f"{path}: cannot read: {exc.strerror}"]) from exc
    except UnicodeDecodeError as exc:
        # Say where, never what: the bytes around it may be part of a key.
        raise PolicyError([f"{path}: not UTF-8 (byte {exc.start})"]) from exc
    return parse_policy(text, source=str(path))


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        data = yaml.safe_load(text)
        tree = yaml.compose(text)
        lines = line_map(tree)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        # The problem, never the snippet: the offending line may hold a `plain:` key.
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise PolicyError([f"{source}: not valid YAML{where}: {problem}"]) from exc
    c = Checker(lines)
    for path, line in duplicate_keys(tree):
        c.problems.append(f"{path} (line {line}): duplicate key")
    policy = _build(c, data)
    if c.problems or policy is None:
        raise PolicyError(c.problems)
    for tenant in policy.tenants.values():
        if tenant.demo_keys:
            log.warning(
                "tenant %s has %d plaintext demo key(s): store `sha256:<digest>` in production",
                tenant.id,
                len(tenant.demo_keys),
            )
    return policy


_TOP = {
    "version",
    "redis",
    "queue",
    "watermarks",
    "edge",
    "tiers",
    "classes",
    "tenants",
    "nodes",
    "shadow",
    "pools",
    "batch",
    "discovery",
}


def _build(c: Checker, data: Any) -> Policy | None:
    top = c.mapping(data, "", _TOP, required={"classes", "tenants", "nodes"})
    if top is None:
        return None
    if top.get("version", 1) != 1:
        c.err("version", f"must be 1, got {shown(top.get('version'))}")
    redis = _redis(c, top.get("redis", {}))
    queue = _queue(c, top.get("queue", {}))
    wm = _watermarks(c, top.get("watermarks", {}))
    edge = _edge(c, top.get("edge", {}))
    tiers = _tiers(c, top.get("tiers", {}))
    classes = _classes(c, top.get("classes"))
    shadow = c.boolean(top, "shadow", "", False)  # every tenant's limits in shadow mode
    tenants = _tenants(c, top.get("tenants"), tiers, classes, shadow)
    nodes = parse_nodes(c, top.get("nodes"))
    discovery = parse_discovery(c, top.get("discovery", {}))
    pools, tenant_pool = parse_pools(c, top.get("pools"), tenants, nodes)
    batch = parse_batch(c, top.get("batch", {}), classes)
    key_index: dict[str, str] = {}
    for t in tenants.values():
        for i, d in enumerate(t.key_digests):
            if d in key_index:
                c.err(f"tenants.{t.id}.keys[{i}]", f"key already belongs to tenant {key_index[d]}")
            key_index[d] = t.id
    served = {m for n in nodes.values() for m in n.models}
    for t in tenants.values() if not discovery.enabled else ():  # registered nodes come later
        for i, m in enumerate(t.models):
            if m not in served:
                c.err(f"tenants.{t.id}.models[{i}]", f"no node serves model {m!r}")
    if c.problems:
        return None
    return Policy(
        redis,
        queue,
        wm,
        edge,
        classes,
        tenants,
        nodes,
        key_index,
        pools,
        tenant_pool,
        batch,
        discovery,
    )


def _redis(c: Checker, raw: Any) -> RedisSettings:
    m = c.mapping(raw, "redis", set(RedisSettings.__dataclass_fields__)) or {}
    d = RedisSettings()
    return RedisSettings(
        url=c.string(m, "url", "redis", d.url, prefixes=("redis://", "rediss://", "unix://")),
        connect_timeout_ms=c.integer(m, "connect_timeout_ms", "redis", d.connect_timeout_ms, lo=1),
        command_timeout_ms=c.integer(m, "command_timeout_ms", "redis", d.command_timeout_ms, lo=1),
        pool_size=c.integer(m, "pool_size", "redis", d.pool_size, lo=1),
        pool_wait_ms=c.integer(m, "pool_wait_ms", "redis", d.pool_wait_ms, lo=1),
        failure_mode=c.choice(m, "failure_mode", "redis", d.failure_mode),
        fail_open_fraction=c.number(
            m, "fail_open_fraction", "redis", d.fail_open_fraction, lo=0, hi=1, lo_open=True
        ),
        cluster=c.boolean(m, "cluster", "redis", d.cluster),
        answer_ahead=c.boolean(m, "answer_ahead", "redis", d.answer_ahead),
    )


def _queue(c: Checker, raw: Any) -> QueueSettings:
    m = c.mapping(raw, "queue", set(QueueSettings.__dataclass_fields__)) or {}
    d = QueueSettings()
    return QueueSettings(
        max_depth=c.integer(m, "max_depth", "queue", d.max_depth, lo=1),
        max_depth_per_tenant=c.integer(
            m, "max_depth_per_tenant", "queue", d.max_depth_per_tenant, lo=1
        ),
        long_request_tokens=c.integer(
            m, "long_request_tokens", "queue", d.long_request_tokens, lo=0
        ),
        # The edge cuts a response off at lease_ttl_s (no answer outlives its lease): a day at
        # most, so that a lost release cannot hold a slot for longer.
        lease_ttl_s=c.number(m, "lease_ttl_s", "queue", d.lease_ttl_s, lo=1, hi=86400),
    )


def _watermarks(c: Checker, raw: Any) -> Watermarks:
    if isinstance(raw, dict):
        raw = _removed(c, raw, "watermarks")
    m = c.mapping(raw, "watermarks", set(Watermarks.__dataclass_fields__)) or {}
    d = Watermarks()
    w = Watermarks(
        hold=c.number(m, "hold", "watermarks", d.hold, lo=0, hi=1, lo_open=True),
        drain=c.number(m, "drain", "watermarks", d.drain, lo=0, hi=1, lo_open=True),
        reopen=c.number(m, "reopen", "watermarks", d.reopen, lo=0, hi=1),
        stale_after_s=c.number(
            m, "stale_after_s", "watermarks", d.stale_after_s, lo=0, lo_open=True
        ),
        tighten_after_s=c.number(m, "tighten_after_s", "watermarks", d.tighten_after_s, lo=0),
        tighten_factor=c.number(
            m, "tighten_factor", "watermarks", d.tighten_factor, lo=0, hi=1, lo_open=True
        ),
    )
    if w.hold >= w.drain:
        c.err("watermarks.hold", f"must be below drain ({w.drain}), got {w.hold}")
    if w.reopen >= w.hold:
        c.err("watermarks.reopen", f"must be below hold ({w.hold}), got {w.reopen}")
    return w


def _edge(c: Checker, raw: Any) -> EdgeSettings:
    m = c.mapping(raw, "edge", set(EdgeSettings.__dataclass_fields__)) or {}
    d = EdgeSettings()
    return EdgeSettings(
        max_body_bytes=c.integer(m, "max_body_bytes", "edge", d.max_body_bytes, lo=1024),
        sidecar_failure_mode=c.choice(m, "sidecar_failure_mode", "edge", d.sidecar_failure_mode),
        chars_per_token=c.number(
            m, "chars_per_token", "edge", d.chars_per_token, lo=0, lo_open=True
        ),
        default_max_tokens=c.integer(m, "default_max_tokens", "edge", d.default_max_tokens, lo=1),
        admit_embeddings=c.boolean(m, "admit_embeddings", "edge", d.admit_embeddings),
        passthrough=_passthrough(c, m.get("passthrough", {})),
    )


# Paths the edge answers itself: never passed through.
EDGE_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
)


def _passthrough(c: Checker, raw: Any) -> dict[str, str]:
    """edge.passthrough: `/v1/...` path → `http://IP:PORT` (an address, not a name: NGINX
    resolves names in proxy_pass only with a resolver of its own)."""
    m = c.mapping(raw, "edge.passthrough", None) or {}
    out: dict[str, str] = {}
    for path, url in m.items():
        where = f"edge.passthrough.{path}"
        if (
            not isinstance(path, str)
            or not re.fullmatch(r"/v1/[A-Za-z0-9_./-]+", path)
            or (".." in path or path.endswith("/"))
        ):
            c.err(where, "must be a path under /v1/, e.g. /v1/responses")
            continue
        if any(
            path == e or path.startswith(e + "/") or e.startswith(path + "/") for e in EDGE_PATHS
        ):
            c.err(where, "is a path the edge admits or serves itself: it cannot be passed through")
            continue
        if not isinstance(url, str) or not _address_url(url):
            c.err(where, f"must be http://IP:PORT (an IP address, no path), got {shown(url)}")
            continue
        out[path] = url
    return out


def _address_url(url: str) -> bool:
    m = re.fullmatch(r"https?://(\[[0-9a-fA-F:.]+\]|[0-9.]+):(\d{1,5})", url)
    if not m:
        return False
    try:
        ipaddress.ip_address(m.group(1).strip("[]"))
    except ValueError:
        return False
    return 0 < int(m.group(2)) < 65536


def _tiers(c: Checker, raw: Any) -> dict[str, float]:
    m = c.mapping(raw, "tiers", None) or {}
    return {str(k): c.number(m, k, "tiers", None, lo=0, lo_open=True) for k in m}


_CLASS_KEYS = {
    "weight",
    "min_share",
    "priority",
    "deadline_s",
    "promote_after_s",
    "slo",
    "admit_until",
    "on_late",
}


def _classes(c: Checker, raw: Any) -> dict[str, ClassPolicy]:
    m = c.mapping(raw, "classes", None)
    if m is None:
        return {}
    if not m:
        c.err("classes", "must define at least one class")
    out: list[ClassPolicy] = []
    for name, body in m.items():
        p = f"classes.{name}"
        b = c.mapping(body, p, _CLASS_KEYS, required={"weight", "priority", "deadline_s"}) or {}
        slo = c.mapping(b.get("slo", {}), f"{p}.slo", {"ttft_ms", "e2e_ms", "tpot_ms"}) or {}
        out.append(
            ClassPolicy(
                name=str(name),
                weight=c.number(b, "weight", p, 1.0, lo=0, lo_open=True),
                min_share=c.number(b, "min_share", p, 0.0, lo=0, hi=1),
                priority=c.integer(b, "priority", p, 0),
                # The edge waits 660 s for an admission answer (admission_locations.conf).
                deadline_s=c.number(b, "deadline_s", p, 30.0, lo=0, lo_open=True, hi=600),
                promote_after_s=c.optional_number(b, "promote_after_s", p, lo=0, lo_open=True),
                slo_ttft_ms=c.optional_number(slo, "ttft_ms", f"{p}.slo", lo=0, lo_open=True),
                slo_e2e_ms=c.optional_number(slo, "e2e_ms", f"{p}.slo", lo=0, lo_open=True),
                slo_tpot_ms=c.optional_number(slo, "tpot_ms", f"{p}.slo", lo=0, lo_open=True),
                admit_until=c.choice(b, "admit_until", p, AdmitUntil.HOLD),
                on_late=c.choice(b, "on_late", p, OnLate.SERVE),
            )
        )
    if sum(k.min_share for k in out) > 1:
        c.err("classes", "min_share values add up to more than 1")
    prios = [k.priority for k in out]
    if len(set(prios)) != len(prios):
        c.err("classes", f"priority values must be distinct, got {prios}")
    out.sort(key=lambda k: k.priority)
    return {k.name: k for k in out}
