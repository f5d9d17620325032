"""The Batch API's state in Redis: files, batches, the line stream and the answers.

Keys (every key of one batch shares the hash tag `{bt:<id>}`, so its scripts run on Redis
Cluster too):
- `adm:file:<id>` hash {tenant, filename, bytes, purpose, created_at; an input file's line
  count and urls, checked once at upload} and `adm:file:<id>:data`
  (the bytes). Output and error files of a batch have ids derived from the batch id, so that
  finalizing twice writes the same files.
- `adm:{bt:<id>}:batch` hash: the OpenAI batch object's fields, counts and timestamps.
- `adm:{bt:<id>}:res` hash custom_id → the answer line (JSON): the exactly-once record.
- `adm:batches:<tenant>` zset batch id → created_at (listing); `adm:batches:open` set of
  batches not yet finished (the workers' sweep).
- `adm:batch:lines` stream, group `workers`: one entry {b, i} per line to run.

Durability: Redis runs with `appendonly yes, appendfsync everysec` (the local stack does): a
Redis crash loses at most the last second of writes. A line whose answer was lost that way is
still pending in the stream (its XACK was lost with it) and runs again; its answer is recorded
once (HSETNX by custom_id).
"""

from __future__ import annotations

import json
import time
from typing import Any

from redis import exceptions as rex

STREAM = "adm:batch:lines"
GROUP = "workers"
OPEN = "adm:batches:open"

TERMINAL = ("completed", "failed", "expired", "cancelled")


def batch_key(bid: str) -> str:
    return f"adm:{{bt:{bid}}}:batch"


def results_key(bid: str) -> str:
    return f"adm:{{bt:{bid}}}:res"


def tenant_batches(tenant: str) -> str:
    return f"adm:batches:{tenant}"


def file_key(fid: str) -> str:
    return f"adm:file:{fid}"


def file_data(fid: str) -> str:
    return f"adm:file:{fid}:data"


# Record one line's answer once; count it; say whether it was the last.
# KEYS: 1 results hash, 2 batch hash. ARGV: 1 custom_id, 2 answer JSON, 3 "completed"|"failed".
# Returns {recorded (0/1), done (answered lines), total}.
RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  local b = redis.call('HMGET', KEYS[2], 'completed', 'failed', 'total')
  return {0, tonumber(b[1] or 0) + tonumber(b[2] or 0), tonumber(b[3] or 0)}
end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
local b = redis.call('HMGET', KEYS[2], 'completed', 'failed', 'total')
return {1, tonumber(b[1] or 0) + tonumber(b[2] or 0), tonumber(b[3] or 0)}
"""


def connect_batch(url: str) -> Any:
    """A client for batch work: files are megabytes and the workers block on the stream, so
    it has its own pool and long timeouts (the admission path keeps its 150 ms ones)."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, socket_timeout=60, socket_connect_timeout=5,
                                   max_connections=64)  # fmt: skip


class BatchStore:
    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._record = redis.register_script(RECORD)

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except rex.ResponseError as exc:  # BUSYGROUP: another worker made it
            if "BUSYGROUP" not in str(exc):
                raise

    # -- files -----------------------------------------------------------------------------
    async def put_file(
        self, fid: str, tenant: str, name: str, purpose: str, data: bytes, **extra: Any
    ) -> dict[str, Any]:
        """Store a file; `extra` fields (an input file's line count and urls) ride in its meta."""
        meta = {"tenant": tenant, "filename": name, "bytes": len(data), "purpose": purpose,
                "created_at": int(time.time()), **extra}  # fmt: skip
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(file_data(fid), data)
        pipe.hset(file_key(fid), mapping=meta)
        await pipe.execute()
        return file_object(fid, meta)

    async def file_meta(self, fid: str) -> dict[str, Any] | None:
        raw = await self.redis.hgetall(file_key(fid))
        return {text(k): text(v) for k, v in raw.items()} if raw else None

    async def file_bytes(self, fid: str) -> bytes | None:
        data = await self.redis.get(file_data(fid))
        return bytes(data) if data is not None else None

    # -- batches ---------------------------------------------------------------------------
    async def create(self, bid: str, tenant: str, fields: dict[str, Any], n_lines: int) -> None:
        """The batch and one stream entry per line, in one transaction (all or nothing)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(batch_key(bid), mapping={**fields, "total": n_lines, "completed": 0, "failed": 0})
        pipe.zadd(tenant_batches(tenant), {bid: fields["created_at"]})
        pipe.sadd(OPEN, bid)
        for i in range(n_lines):
            pipe.xadd(STREAM, {"b": bid, "i": i})
        await pipe.execute()

    async def get(self, bid: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(batch_key(bid))
        return {text(k): text(v) for k, v in raw.items()} if raw else None

    async def set_fields(self, bid: str, **fields: Any) -> None:
        await self.redis.hset(batch_key(bid), mapping=fields)

    async def set_status(self, bid: str, status: str, only_if: tuple[str, ...] = ()) -> bool:
        """Move to `status` (stamping `<status>_at`), if the current one is in `only_if`."""
        key = batch_key(bid)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    cur = text(await pipe.hget(key, "status") or b"")
                    if only_if and cur not in only_if:
                        await pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.hset(key, mapping={"status": status, f"{status}_at": int(time.time())})
                    if status in TERMINAL:
                        pipe.srem(OPEN, bid)
                    await pipe.execute()
                    return True
                except rex.WatchError:  # someone else changed it meanwhile: read again
                    continue

    async def list(self, tenant: str, after: str | None, limit: int) -> list[str]:
        ids = [text(b) for b in await self.redis.zrevrange(tenant_batches(tenant), 0, -1)]
        if after and after in ids:
            ids = ids[ids.index(after) + 1 :]
        return ids[:limit]

    async def open_count(self, tenant: str) -> int:
        ids = [text(b) for b in await self.redis.smembers(OPEN)]
        if not ids:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for b in ids:
            pipe.hget(batch_key(b), "tenant")
        return sum(1 for t in await pipe.execute() if t is not None and text(t) == tenant)

    async def record(
        self, bid: str, custom_id: str, answer: dict[str, Any], ok: bool
    ) -> tuple[bool, int, int]:
        r = await self._record(keys=[results_key(bid), batch_key(bid)],
                               args=[custom_id, json.dumps(answer), "completed" if ok else "failed"])  # fmt: skip
        return bool(int(r[0])), int(r[1]), int(r[2])

    async def answers(self, bid: str) -> dict[str, str]:
        raw = await self.redis.hgetall(results_key(bid))
        return {text(k): text(v) for k, v in raw.items()}


def file_object(fid: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"id": fid, "object": "file", "bytes": int(meta["bytes"]),
            "created_at": int(meta["created_at"]), "filename": meta["filename"],
            "purpose": meta["purpose"], "status": "processed"}  # fmt: skip


def batch_object(bid: str, b: dict[str, str]) -> dict[str, Any]:
    def ts(name: str) -> int | None:
        v = b.get(f"{name}_at")
        return int(v) if v else None

    return {
        "id": bid,
        "object": "batch",
        "endpoint": b.get("endpoint"),
        "errors": json.loads(b["errors"]) if b.get("errors") else None,
        "input_file_id": b.get("input_file_id"),
        "completion_window": b.get("completion_window", "24h"),
        "status": b.get("status"),
        "output_file_id": b.get("output_file_id") or None,
        "error_file_id": b.get("error_file_id") or None,
        "created_at": int(b.get("created_at", 0)),
        "in_progress_at": ts("in_progress"),
        "expires_at": int(b["expires_at"]) if b.get("expires_at") else None,
        "finalizing_at": ts("finalizing"),
        "completed_at": ts("completed"),
        "failed_at": ts("failed"),
        "expired_at": ts("expired"),
        "cancelling_at": ts("cancelling"),
        "cancelled_at": ts("cancelled"),
        "request_counts": {
            "total": int(b.get("total", 0)),
            "completed": int(b.get("completed", 0)),
            "failed": int(b.get("failed", 0)),
        },
        "metadata": json.loads(b["metadata"]) if b.get("metadata") else None,
    }


def text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
