"""Tenant node pools (`pools:` in policies.yaml), and the Batch API's settings (`batch:`).

A pool is a set of nodes (`nodes.<id>.pool`) that some tenants own (`pools.<name>.tenants`, or
every tenant of `pools.<name>.tiers`): a MIG slice or a whole GPU as a tenant's guaranteed
baseline. The owners' requests go to their pool's nodes first. `lend` (default true): while no
owner waits, other tenants' requests may use the pool's idle capacity, and owners take it back
by admission order (the next free slot goes to a waiting owner; running work is never killed).
`spill` (default true): when their pool is full, owners' requests may also use shared nodes;
false keeps them queued for their pool.
"""

from __future__ import annotations

from typing import Any

from admission.policy.checks import Checker
from admission.policy.model import BatchSettings, Node, Pool, Tenant


def parse_pools(
    c: Checker, raw: Any, tenants: dict[str, Tenant], nodes: dict[str, Node]
) -> tuple[dict[str, Pool], dict[str, str]]:
    """(pools by name, owning pool by tenant id)."""
    m = c.mapping(raw, "pools", None) if raw is not None else {}
    pools: dict[str, Pool] = {}
    owner: dict[str, str] = {}
    for name, body in (m or {}).items():
        p = f"pools.{name}"
        b = c.mapping(body, p, {"tenants", "tiers", "lend", "spill"}) or {}
        named = c.string_list(b, "tenants", p, [])
        tiers = c.string_list(b, "tiers", p, [])
        for t in named:
            if t not in tenants:
                c.err(f"{p}.tenants", f"no tenant {t!r}")
        members = set(named) | {t.id for t in tenants.values() if t.tier in tiers}
        if not members:
            c.err(p, "no tenant owns this pool (tenants or tiers)")
        for t in sorted(members):
            if t in owner:
                c.err(p, f"tenant {t} is already in pool {owner[t]}")
            owner[t] = str(name)
        if not any(n.pool == name for n in nodes.values()):
            c.err(p, "no node is in this pool (nodes.<id>.pool)")
        pools[str(name)] = Pool(
            str(name),
            tuple(sorted(members)),
            lend=c.boolean(b, "lend", p, True),
            spill=c.boolean(b, "spill", p, True),
        )
    for n in nodes.values():
        if n.pool is not None and n.pool not in pools:
            c.err(f"nodes.{n.id}.pool", f"no pool {n.pool!r} under pools")
    return pools, owner


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def parse_batch(c: Checker, raw: Any, classes: dict[str, Any]) -> BatchSettings:
    """`batch:`: the OpenAI Batch API's bounds and the class its lines run at."""
    m = c.mapping(raw, "batch", set(BatchSettings.__dataclass_fields__)) or {}
    d = BatchSettings()
    b = BatchSettings(
        max_file_bytes=c.integer(m, "max_file_bytes", "batch", d.max_file_bytes, lo=1024),
        max_lines=c.integer(m, "max_lines", "batch", d.max_lines, lo=1),
        max_open_per_tenant=c.integer(
            m, "max_open_per_tenant", "batch", d.max_open_per_tenant, lo=1
        ),
        line_class=c.string(m, "line_class", "batch", d.line_class),
        max_attempts=c.integer(m, "max_attempts", "batch", d.max_attempts, lo=1),
        max_files_per_tenant=c.integer(
            m, "max_files_per_tenant", "batch", d.max_files_per_tenant, lo=1, hi=5000
        ),
        max_stored_bytes_per_tenant=c.integer(
            m, "max_stored_bytes_per_tenant", "batch", d.max_stored_bytes_per_tenant, lo=1024
        ),
        max_uploads_per_min=c.integer(
            m, "max_uploads_per_min", "batch", d.max_uploads_per_min, lo=1
        ),
        # OpenAI's bounds for expires_after.seconds: an hour to 30 days.
        file_ttl_s=c.integer(m, "file_ttl_s", "batch", d.file_ttl_s, lo=3600, hi=30 * 86400),
        redis_url=c.string(m, "redis_url", "batch", "", prefixes=REDIS_SCHEMES) or None,
    )
    if b.max_stored_bytes_per_tenant < b.max_file_bytes:
        c.err("batch.max_stored_bytes_per_tenant", "must be >= batch.max_file_bytes")
    # The default names a class the policy may not have: the worker then uses the tenant's
    # least urgent class. Set explicitly, it must exist.
    if "line_class" in m and classes and b.line_class not in classes:
        c.err("batch.line_class", f"no class {b.line_class!r}")
    return b
