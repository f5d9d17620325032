"""Every Redis key the project uses, defined in one place.

Keys a script touches together share one hash tag (`{t:<tenant>}` or `{n:<node>}`), so every
script runs unchanged on Redis Cluster.
"""

from __future__ import annotations

import functools

PREFIX = "adm"


@functools.lru_cache(maxsize=65536)
def _tenant_prefixes(tenant: str) -> tuple[bytes, ...]:
    tag = f"{PREFIX}:{{t:{tenant}}}"
    return tuple(f"{tag}:{k}".encode() for k in ("rq", "tk", "bw", "cc", "res:"))


def tenant_keys(tenant: str, rid: str) -> list[bytes]:
    """The keys of the acquire/settle scripts, in the order the scripts expect them (encoded:
    they are on every admission's path, and all but the reservation are the tenant's own)."""
    rq, tk, bw, cc, res = _tenant_prefixes(tenant)
    return [
        rq,  # request bucket: hash {l: level in micro-requests, t: last refill µs}
        tk,  # LLM-token bucket: same shape, micro-tokens
        bw,  # burst guard: zset rid → admit time µs (sliding window)
        cc,  # concurrency leases: zset rid → expiry µs
        res + rid.encode(),  # reservation: hash {tok: reserved tokens}; TTL = lease TTL
    ]


@functools.lru_cache(maxsize=65536)
def node_leases(node: str) -> str:
    """In-flight leases on a node: zset ticket → expiry µs (taken atomically by lease.lua)."""
    return f"{PREFIX}:{{n:{node}}}:leases"


@functools.lru_cache(maxsize=65536)
def node_ledger(node: str) -> str:
    """What a node will hold: hash {p: pending prefill tokens, t: µs, kv: reserved KV tokens,
    u: the urgent class's part of kv, r: the urgent reserve as of rt (µs), k:<ticket>: one
    lease's KV tokens, negative for an urgent lease, s: the part of kv that is shared prefix
    blocks held, h:<hash>: a block's reference count, b:<ticket>: a lease's blocks, pb:
    prefill booked in all (a counter, read by the agent)}
    (lease.lua, unlease.lua)."""
    return f"{PREFIX}:{{n:{node}}}:ledger"


@functools.lru_cache(maxsize=65536)
def node_prefixes(node: str) -> str:
    """Prefix blocks resident on a node (zset hash → µs last used; reference counts are ledger
    fields h:<hash>, a lease's blocks b:<ticket>): what its engine has computed, as booked."""
    return f"{PREFIX}:{{n:{node}}}:prefixes"


def prefix_feed() -> str:
    """Where sidecars tell each other which node took which prompt head (stream: s = sidecar,
    n = node, b = block hashes), read with the node refresh: a sidecar's prefix index then knows
    what the others placed within one refresh, without a Redis call on the admission path."""
    return f"{PREFIX}:prefix-feed"


def node_gone(node: str) -> str:
    """Releases that found no lease (zset ticket → expiry µs): a booking still on its way (a
    request answered ahead of it) must not book what already ended."""
    return f"{PREFIX}:{{n:{node}}}:gone"


def node_state(node: str) -> str:
    """The node agent's latest sample (JSON), with a TTL of a few sample periods."""
    return f"{PREFIX}:{{n:{node}}}:state"


def node_eject(node: str) -> str:
    """Set (with a TTL) when proxied requests keep failing to reach the node: out of rotation
    on every sidecar until it expires."""
    return f"{PREFIX}:{{n:{node}}}:eject"


def node_fails(node: str) -> str:
    """Tickets of proxied requests that could not reach the node (a set, over a short window:
    a release delivered twice counts once)."""
    return f"{PREFIX}:{{n:{node}}}:failed"


def node_admin(node: str) -> str:
    """Set by an SRE (`admission node drain`): the node takes nothing new until cleared."""
    return f"{PREFIX}:{{n:{node}}}:admin"


# Registered nodes (nodes/registry.py): each node's signed spec, a version bumped on every
# change (sidecars read the specs only when it moved), and each one's last heartbeat.
REGISTRY = f"{PREFIX}:registry"
REGISTRY_VERSION = f"{PREFIX}:registry:v"
REGISTRY_ALIVE = f"{PREFIX}:registry:alive"


def all_tenant_keys_pattern() -> str:
    return f"{PREFIX}:{{t:*"


# -- the Batch API (admission/batch) ------------------------------------------------------------
# Every key of a tenant's files and batches shares the tag `{bt:<tenant>}`, so the scripts that
# touch several (quota, commit, create, delete) run unchanged on Redis Cluster. Two keys are
# global, each alone in its slot: the line stream and the index of open batches.
BATCH_LINES = f"{PREFIX}:batch:lines"  # stream, group `workers`: {t: tenant, b: batch, i: line}
BATCHES_OPEN = f"{PREFIX}:batch:open"  # hash batch id → tenant: batches not yet finished


def _bt(tenant: str) -> str:
    return f"{PREFIX}:{{bt:{tenant}}}"


def batch_files(tenant: str) -> str:
    """The tenant's files (zset id → expires_at s), uploads in progress included: the quota."""
    return f"{_bt(tenant)}:files"


def batch_usage(tenant: str) -> str:
    """Bytes per file (hash id → bytes; an upload in progress: what it may take)."""
    return f"{_bt(tenant)}:usage"


def batch_uploads(tenant: str) -> str:
    """Uploads begun in the last minute (zset id → s): the upload rate bound."""
    return f"{_bt(tenant)}:uploads"


def batch_file(tenant: str, fid: str) -> str:
    """A file's meta (hash: filename, bytes, purpose, created_at, expires_at, parts; an input's
    lines and urls); TTL = the file's life."""
    return f"{_bt(tenant)}:file:{fid}"


def batch_file_part(tenant: str, fid: str, n: int) -> str:
    """Part n of a file's bytes (strings of at most PART_BYTES: no value near Redis's 512 MB)."""
    return f"{_bt(tenant)}:file:{fid}:part:{n}"


def batch_file_index(tenant: str, fid: str) -> str:
    """An input file's lines: (start, end) byte offsets, little-endian uint32 pairs."""
    return f"{_bt(tenant)}:file:{fid}:index"


def batch(tenant: str, bid: str) -> str:
    """A batch's fields (hash: the OpenAI batch object's fields, counts, timestamps)."""
    return f"{_bt(tenant)}:batch:{bid}"


def batch_results(tenant: str, bid: str) -> str:
    """A batch's answers (hash line index → "1"|"0" + answer JSON): the exactly-once record."""
    return f"{_bt(tenant)}:batch:{bid}:res"


def tenant_batches(tenant: str) -> str:
    """The tenant's batches (zset id → created_at): listing."""
    return f"{_bt(tenant)}:batches"


def tenant_open_batches(tenant: str) -> str:
    """The tenant's batches not yet finished (set): max_open_per_tenant, and files in use."""
    return f"{_bt(tenant)}:open"


def node_changes() -> str:
    """The node change feed (stream: n = node, k = kind, v = value; nodes/feed.py): agents say
    when a node's state moved or that it is still alive, sidecars when an operator drained it
    or proxied requests ejected it. Sidecars read it with every refresh, in one XRANGE."""
    return f"{PREFIX}:node-changes"


def tenant_shares(model: str, cls: str) -> str:
    """Tenants' normalised service and who waits, for one model and class, across sidecars
    (hash: s:<tenant> = tokens admitted ÷ weight, w:<tenant> = ms last seen waiting;
    scheduling/shares.py)."""
    return f"{PREFIX}:shares:{model}:{cls}"
