"""The policy model: what an SRE writes in policies.yaml, as frozen, validated dataclasses.

Pure: no aiohttp, no redis. `parse_policy` collects *every* problem (dotted path, YAML line
where known) into one `PolicyError`; nothing half-valid ever reaches the running service.
The field-by-field reference lives in README.md ("Configuration reference").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FailureMode(StrEnum):
    """What to do when a dependency (Redis, every sidecar) cannot answer."""

    OPEN = "open"  # keep serving: local buckets at a fraction of the rate / proxy unadmitted
    CLOSED = "closed"  # refuse: 503 with Retry-After


class AdmitUntil(StrEnum):
    """The watermark at which a class stops being admitted to a node."""

    HOLD = "hold"
    DRAIN = "drain"


class OnLate(StrEnum):
    """What to do with a queued request that can no longer meet its class's TTFT target."""

    SERVE = "serve"  # keep it: it runs late
    REFUSE = "refuse"  # 429 slo_unreachable now, with Retry-After: capacity goes to work on time


class MemorySource(StrEnum):
    """Which reading a node's watermarks compare (see admission.nodes.memory)."""

    EFFECTIVE = "effective"  # NVML used − free part of the KV pool
    KV = "kv"  # vLLM's KV usage alone (CPU vLLM: no NVML)
    NVML = "nvml"  # raw NVML (no vLLM metrics)


@dataclass(frozen=True)
class RedisSettings:
    """Where shared state lives and how hard we try to reach it.

    Timeouts are short on purpose: an admission decision that waits on a sick Redis is worse
    than the fail-open/closed answer.
    """

    url: str = "redis://127.0.0.1:6379/0"
    connect_timeout_ms: int = 250
    command_timeout_ms: int = 150
    pool_size: int = 64  # connections per sidecar process; callers beyond it wait (blocking pool)
    pool_wait_ms: int = 100
    failure_mode: FailureMode = (
        FailureMode.OPEN
    )  # open: local buckets at a fraction of the rate; closed: 503
    fail_open_fraction: float = (
        0.5  # share of each rate a sidecar grants itself while Redis is down
    )
    cluster: bool = False
    # Answer a fast-path admission before its Redis round trip returns when the last figures
    # show room for twice what it then has out (scheduling/answer_ahead.py); false: every one waits.
    answer_ahead: bool = True


@dataclass(frozen=True)
class QueueSettings:
    """Bounds of the weighted-fair queue (per sidecar process)."""

    max_depth: int = 10_000
    max_depth_per_tenant: int = 1_000
    long_request_tokens: int = 0  # > 0: requests estimated above this drop one class; 0 = off
    lease_ttl_s: float = 600.0  # longest a request may run; a lost release frees its slots then


@dataclass(frozen=True)
class Watermarks:
    """Node memory thresholds as fractions of GPU memory (effective, see DESIGN.md)."""

    hold: float = 0.80  # at or above: no new admissions, requests wait in the queue
    drain: float = 0.85  # at or above: no new requests at all; in-flight finish
    reopen: float = 0.75  # hysteresis: a held/drained node opens again below this
    stale_after_s: float = 3.0  # a node state older than this means the node is down
    # Memory-aware limits: when every live node of a model has been held (at or above `hold`)
    # for `tighten_after_s`, the token-bucket rates of classes below the most urgent one are
    # multiplied by `tighten_factor` until a node of the model opens again. 1.0 = off.
    tighten_after_s: float = 30.0
    tighten_factor: float = 1.0


@dataclass(frozen=True)
class ClassPolicy:
    """A request class: its share of capacity, patience and the vLLM priority it maps to."""

    name: str
    weight: float
    min_share: float  # fraction of admitted cost guaranteed when backlogged (0 = none)
    priority: int  # vLLM `priority` field: lower runs earlier
    deadline_s: float  # max wait in the queue before 503 queue_timeout
    promote_after_s: float | None  # waited this long → moves up one class (None: never)
    slo_ttft_ms: float | None = None
    slo_e2e_ms: float | None = None
    # Time per output token this class's answers must keep. On the most urgent class it is also
    # a guard: a node whose decode is already this slow gets no more work of lower classes.
    slo_tpot_ms: float | None = None
    # Watermark at which this class stops being admitted to a node: "hold" (default) or "drain".
    # An urgent class admitted until drain keeps flowing while a node is held: vLLM's priority
    # scheduler makes room for it by preempting lower classes, which the edge keeps out.
    admit_until: AdmitUntil = AdmitUntil.HOLD
    on_late: OnLate = OnLate.SERVE

    @property
    def refuses_late(self) -> bool:
        """`on_late: refuse` with a TTFT target: refused early once it cannot be in time."""
        return self.on_late == OnLate.REFUSE and bool(self.slo_ttft_ms)


@dataclass(frozen=True)
class Limits:
    """Per-tenant limits, enforced across all sidecars in Redis."""

    requests_per_s: float
    request_burst: int
    tokens_per_min: float
    token_burst: int
    burst_window_s: float = 1.0  # sliding window of the burst guard
    burst_max: int = 0  # max requests in any burst window; 0 = guard off
    max_concurrent: int = 0  # requests admitted and not yet released; 0 = unlimited
    max_queued: int = 0  # per-sidecar queue bound for this tenant; 0 = queue default
    # What a prompt token the engine found in its prefix cache costs in the token bucket, as a
    # fraction of a computed one (settled from the engine's reported cached tokens). 1.0: the
    # same (a cached prefix is not cheaper for the tenant); 0.1: what providers bill.
    cached_token_price: float = 1.0


@dataclass(frozen=True)
class Tenant:
    id: str
    tier: str
    weight: float
    key_digests: tuple[str, ...]  # lowercase hex SHA-256 of each API key
    classes: tuple[str, ...]
    default_class: str
    limits: Limits
    models: tuple[str, ...] = ()  # empty: every model some node serves
    demo_keys: tuple[str, ...] = ()  # plaintext keys, demo only (never logged)
    # Limits evaluated and counted (admission_shadow_decisions_total) but not enforced: try new
    # limits on live traffic before they bite.
    shadow: bool = False
    # Tenants naming one group share the engine's prefix cache (one organisation's teams, a
    # public system prompt); None: the tenant's cache is its own (admission/cache_salt.py).
    cache_group: str | None = None


@dataclass(frozen=True)
class Node:
    id: str
    url: str  # base URL of the vLLM OpenAI server, e.g. http://10.0.0.5:8000
    models: tuple[str, ...]
    memory_source: MemorySource = MemorySource.EFFECTIVE
    max_inflight: int = 64
    kv_pool_bytes: int | None = None  # overrides what vLLM's cache_config_info reports
    # NVML devices the node's vLLM uses (tensor parallel: several): indices, or UUIDs ("GPU-…",
    # "MIG-…": a MIG instance is a node of its own).
    gpus: tuple[int | str, ...] = (0,)
    device_url: str | None = None  # emulator only: simulated GPU read instead of NVML
    pool: str | None = None  # a tenant pool's node (pools.py); None: shared by every tenant


@dataclass(frozen=True)
class Discovery:
    """`discovery:`: nodes that register themselves (admission agent --register)."""

    enabled: bool = False
    allow: tuple[str, ...] = ()  # networks a registered node's URL must be in
    secret_file: str | None = None  # the shared secret registrations are signed with
    forget_after_s: float = 300.0  # a registered node silent this long leaves the views
    max_nodes: int = 4096  # registrations taken at most (the registry's bound)
    # model (or "*": every model) → node keys a registration that leaves them out takes
    defaults: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Pool:
    """Nodes some tenants own (policy/pools.py)."""

    name: str
    tenants: tuple[str, ...]
    lend: bool = True  # idle capacity serves others while no owner waits
    spill: bool = True  # owners may use shared nodes when their pool is full


@dataclass(frozen=True)
class BatchSettings:
    """The OpenAI Batch API (admission/batch): bounds, and the class its lines run at."""

    max_file_bytes: int = 50 << 20  # an uploaded JSONL file; larger: 413
    max_lines: int = 50_000  # lines (requests) per batch
    max_open_per_tenant: int = 10  # batches not yet finished, per tenant; more: 429
    line_class: str = "offline"  # the class lines run at (the tenant's least urgent if not allowed)
    max_attempts: int = 8  # retryable refusals (429, 503, 5xx) before a line fails
    # What one tenant may keep stored (inputs and outputs): bounds the Redis batch storage
    # takes to tenants x max_stored_bytes_per_tenant, whatever a tenant uploads.
    max_files_per_tenant: int = 100
    max_stored_bytes_per_tenant: int = 1 << 30
    max_uploads_per_min: int = 30  # per tenant; more: 429 uploads_per_min
    file_ttl_s: int = 30 * 86400  # a file's life unless it asks for less (expires_after)
    redis_url: str | None = None  # batch storage on its own Redis (default: redis.url)


@dataclass(frozen=True)
class EdgeSettings:
    max_body_bytes: int = 1_048_576
    sidecar_failure_mode: FailureMode = (
        FailureMode.CLOSED
    )  # no sidecar reachable: open = proxy unadmitted (logged)
    chars_per_token: float = 4.0  # prompt-size estimate at the edge
    default_max_tokens: int = 256  # cost estimate when a request sets no max_tokens
    admit_embeddings: bool = False  # /v1/embeddings admitted and charged by input tokens (or 404)
    # Other /v1/ paths passed after the key check only (not admitted, not charged): path → URL.
    passthrough: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    redis: RedisSettings
    queue: QueueSettings
    watermarks: Watermarks
    edge: EdgeSettings
    classes: dict[str, ClassPolicy]  # ordered most urgent first (lowest priority value)
    tenants: dict[str, Tenant]
    nodes: dict[str, Node]
    key_index: dict[str, str] = field(default_factory=dict)  # sha256 digest → tenant id
    pools: dict[str, Pool] = field(default_factory=dict)
    tenant_pool: dict[str, str] = field(default_factory=dict)  # tenant id → the pool it owns
    batch: BatchSettings = field(default_factory=BatchSettings)
    discovery: Discovery = field(default_factory=Discovery)

    def class_above(self, name: str) -> str:
        """The next more urgent class (aging), or `name` itself at the top."""
        order = list(self.classes)
        i = order.index(name)
        return order[max(0, i - 1)]

    def weight_of(self, tenant: str) -> float:
        """A tenant's weight; 1.0 for one the policy does not name (any more)."""
        t = self.tenants.get(tenant)
        return t.weight if t is not None else 1.0

    def is_urgent(self, cls: str | None) -> bool:
        """A class admitted until drain: not held back by memory lower classes hold, nor by
        the idle-prefill rule (vLLM's priority scheduling runs it first inside the engine); its
        own prefill budget applies when it refuses late (`ClassPolicy.refuses_late`)."""
        c = self.classes.get(cls) if cls else None
        return c is not None and c.admit_until == AdmitUntil.DRAIN

    def class_below(self, name: str) -> str:
        order = list(self.classes)
        i = order.index(name)
        return order[min(len(order) - 1, i + 1)]

    def models(self) -> set[str]:
        return {m for n in self.nodes.values() for m in n.models}


def digest_key(api_key: str) -> str:
    """SHA-256 hex digest of an API key: the only form keys are stored or compared in."""
    return hashlib.sha256(api_key.encode()).hexdigest()
