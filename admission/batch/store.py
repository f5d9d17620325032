"""The Batch API's state in Redis: files in parts, batches, the line stream and the answers.

Keys and scripts live with every other key (admission/store/keys.py, store/lua/batch_*.lua):
all of a tenant's files and batches share one hash tag, so quota, commit, create and delete are
single scripts on Redis Cluster too. A file is stored in parts of at most `PART_BYTES` (no
value near Redis's 512 MB limit, and no upload or output held whole in a process), an input
file with an index of its lines' byte offsets (a worker reads one line, not the file). Every
file has a life (`expires_after`, or `batch.file_ttl_s`) and counts against its tenant's quota
until it is deleted or expires.

Durability: Redis runs with `appendonly yes, appendfsync everysec` (the local stack does): a
Redis crash loses at most the last second of writes. A line whose answer was lost that way is
still pending in the stream (its XACK was lost with it) and runs again; its answer is recorded
once (HSETNX by line index).

One job over 350 lines: the Batch API's Redis state, each method one script or pipeline on
the same tenant-tagged keys; the routes and the worker only call it.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from redis import exceptions as rex

from admission.errors import PayloadTooLarge, Throttled
from admission.policy.model import BatchSettings
from admission.store import keys

STREAM = keys.BATCH_LINES
GROUP = "workers"
OPEN = keys.BATCHES_OPEN
PART_BYTES = 8 << 20
UPLOAD_WINDOW_S = 3600  # an upload that never ends stops counting against the quota then
TERMINAL = ("completed", "failed", "expired", "cancelled")
SCRIPTS = (
    "batch_upload",
    "batch_commit",
    "batch_create",
    "batch_delete",
    "batch_record",
    "batch_status",
)


def _lua(name: str) -> str:
    return resources.files("admission.store").joinpath(f"lua/{name}.lua").read_text()


class BatchStore:
    def __init__(self, redis: Any, part_bytes: int = PART_BYTES) -> None:
        self.redis = redis
        self.part_bytes = part_bytes
        self._scripts = {n: redis.register_script(_lua(n)) for n in SCRIPTS}

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except rex.ResponseError as exc:  # BUSYGROUP: another worker made it
            if "BUSYGROUP" not in str(exc):
                raise

    # -- files -----------------------------------------------------------------------------
    async def begin_upload(self, tenant: str, fid: str, reserve: int, b: BatchSettings) -> None:
        """Reserve room for an upload of up to `reserve` bytes, or refuse it: too many files
        (429), over the byte quota (413), over the upload rate (429)."""
        now = time.time()
        code, n = await self._scripts["batch_upload"](
            keys=[keys.batch_files(tenant), keys.batch_usage(tenant), keys.batch_uploads(tenant)],
            args=[
                now,
                fid,
                reserve,
                b.max_files_per_tenant,
                b.max_stored_bytes_per_tenant,
                b.max_uploads_per_min,
                now + UPLOAD_WINDOW_S,
            ],
        )
        if code == -1:
            raise Throttled(
                "too_many_files",
                60.0,
                f"{b.max_files_per_tenant} files stored "
                "(batch.max_files_per_tenant): delete some first",
            )
        if code == -2:
            raise PayloadTooLarge(
                f"{n} of {b.max_stored_bytes_per_tenant} bytes stored "
                "(batch.max_stored_bytes_per_tenant): delete files first",
                code="storage_quota_exceeded",
            )
        if code == -3:
            raise Throttled(
                "uploads_per_min",
                float(n),
                f"more than {b.max_uploads_per_min} uploads a minute (batch.max_uploads_per_min)",
            )

    async def abort_upload(self, tenant: str, fid: str, parts: int) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(keys.batch_files(tenant), fid)
        pipe.hdel(keys.batch_usage(tenant), fid)
        for n in range(parts):
            pipe.delete(keys.batch_file_part(tenant, fid, n))
        await pipe.execute()

    async def put_part(self, tenant: str, fid: str, n: int, data: bytes) -> None:
        """Part `n` of a file being written; it lives UPLOAD_WINDOW_S until committed."""
        await self.redis.set(keys.batch_file_part(tenant, fid, n), data, ex=UPLOAD_WINDOW_S)

    async def commit_file(
        self, tenant: str, fid: str, meta: dict[str, Any], index: bytes = b""
    ) -> dict[str, Any]:
        """Make a written file visible: its meta, every key its life, its size in the quota."""
        life = max(1, int(meta["expires_at"]) - int(time.time()))
        parts = [keys.batch_file_part(tenant, fid, n) for n in range(int(meta["parts"]))]
        pairs = [x for kv in meta.items() for x in (kv[0], str(kv[1]))]
        await self._scripts["batch_commit"](
            keys=[
                keys.batch_files(tenant),
                keys.batch_usage(tenant),
                keys.batch_file(tenant, fid),
                keys.batch_file_index(tenant, fid),
                *parts,
            ],
            args=[fid, meta["bytes"], meta["expires_at"], life, index, *pairs],
        )
        return file_object(fid, meta)

    async def file_meta(self, tenant: str, fid: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(keys.batch_file(tenant, fid))
        return {text(k): text(v) for k, v in raw.items()} if raw else None

    async def file_parts(self, tenant: str, fid: str, parts: int) -> AsyncIterator[bytes]:
        for n in range(parts):
            data = await self.redis.get(keys.batch_file_part(tenant, fid, n))
            if data is None:  # expired or deleted while read
                return
            yield bytes(data)

    async def line(self, tenant: str, fid: str, idx: int) -> bytes | None:
        """Line `idx` of an input file (by its index), or None when the file is gone."""
        raw = await self.redis.getrange(keys.batch_file_index(tenant, fid), 8 * idx, 8 * idx + 7)
        if len(raw) != 8:
            return None
        start, end = struct.unpack("<II", raw)
        out = b""
        for n in range(start // self.part_bytes, (end - 1) // self.part_bytes + 1):
            base = n * self.part_bytes
            lo, hi = max(start, base) - base, min(end, base + self.part_bytes) - base - 1
            got = await self.redis.getrange(keys.batch_file_part(tenant, fid, n), lo, hi)
            if len(got) != hi - lo + 1:
                return None
            out += got
        return out

    async def list_files(self, tenant: str) -> list[dict[str, Any]]:
        ids = [text(f) for f in await self.redis.zrange(keys.batch_files(tenant), 0, -1)]
        out = []
        for fid in ids:
            if (meta := await self.file_meta(tenant, fid)) is not None:
                out.append(file_object(fid, meta))
        return sorted(out, key=lambda f: (-f["created_at"], f["id"]))

    async def delete_file(self, tenant: str, fid: str) -> int:
        """1 deleted, 0 no such file, -1 an open batch reads it."""
        for _ in range(20):
            meta = await self.file_meta(tenant, fid)
            parts = int(meta.get("parts", 0)) if meta else 0
            open_ids = [
                text(b) for b in await self.redis.smembers(keys.tenant_open_batches(tenant))
            ]
            r = await self._scripts["batch_delete"](
                keys=[
                    keys.batch_files(tenant),
                    keys.batch_usage(tenant),
                    keys.batch_file(tenant, fid),
                    keys.batch_file_index(tenant, fid),
                    keys.tenant_open_batches(tenant),
                    *[keys.batch_file_part(tenant, fid, n) for n in range(parts)],
                    *[keys.batch(tenant, b) for b in open_ids],
                ],
                args=[fid, parts, len(open_ids)],
            )
            if int(r) != -2:
                return int(r)
        return -1

    # -- batches ---------------------------------------------------------------------------
    async def create(
        self,
        tenant: str,
        bid: str,
        fields: dict[str, Any],
        input_meta: dict[str, str],
        max_open: int,
    ) -> int:
        """1 created (its lines still to enqueue), 0 too many open, -1 the input is gone."""
        fid = fields["input_file_id"]
        parts = [keys.batch_file_part(tenant, fid, n) for n in range(int(input_meta["parts"]))]
        keep = int(fields["expires_at"]) + 86400  # the input outlives the batch's window
        pairs = [x for kv in fields.items() for x in (kv[0], str(kv[1]))]
        r = await self._scripts["batch_create"](
            keys=[
                keys.batch(tenant, bid),
                keys.tenant_batches(tenant),
                keys.tenant_open_batches(tenant),
                keys.batch_files(tenant),
                keys.batch_file(tenant, fid),
                keys.batch_file_index(tenant, fid),
                *parts,
            ],
            args=[bid, max_open, fields["created_at"], keep, fid, *pairs],
        )
        if int(r) == 1:
            await self.redis.hset(OPEN, bid, tenant)
        return int(r)

    async def enqueue(self, tenant: str, bid: str, total: int, start: int = 0) -> None:
        """One stream entry per line from `start`; `queued` says how far it got (a sidecar that
        died midway leaves the rest to the workers' sweep)."""
        for lo in range(start, total, 1000):
            pipe = self.redis.pipeline(transaction=False)
            for i in range(lo, min(total, lo + 1000)):
                pipe.xadd(STREAM, {"t": tenant, "b": bid, "i": i})
            await pipe.execute()
            await self.redis.hset(keys.batch(tenant, bid), "queued", min(total, lo + 1000))

    async def get(self, tenant: str, bid: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(keys.batch(tenant, bid))
        return {text(k): text(v) for k, v in raw.items()} if raw else None

    async def set_fields(self, tenant: str, bid: str, **fields: Any) -> None:
        await self.redis.hset(keys.batch(tenant, bid), mapping=fields)

    async def set_status(
        self, tenant: str, bid: str, status: str, only_if: tuple[str, ...] = ()
    ) -> bool:
        """Move to `status` (stamping `<status>_at`), if the current one is in `only_if`."""
        terminal = status in TERMINAL
        moved = await self._scripts["batch_status"](
            keys=[keys.batch(tenant, bid), keys.tenant_open_batches(tenant)],
            args=[status, int(time.time()), bid, "1" if terminal else "0", *only_if],
        )
        if not int(moved):
            return False
        if status in TERMINAL:
            await self.redis.hdel(OPEN, bid)
        return True

    async def batch_ids(self, tenant: str, after: str | None, limit: int) -> list[str]:
        """A page of the tenant's batches, newest first: `limit` after `after` (its rank is
        looked up, never the whole list read)."""
        listed = keys.tenant_batches(tenant)
        start = 0
        if after:
            rank = await self.redis.zrevrank(listed, after)
            start = rank + 1 if rank is not None else 0
        return [text(b) for b in await self.redis.zrevrange(listed, start, start + limit - 1)]

    async def open_batches(self) -> dict[str, str]:
        """Batch id → tenant, of every batch not yet finished (the workers' sweep)."""
        return {text(b): text(t) for b, t in (await self.redis.hgetall(OPEN)).items()}

    async def record(
        self, tenant: str, bid: str, idx: int, answer: dict[str, Any], ok: bool, until: int
    ) -> tuple[bool, int, int]:
        """Record a line's answer once; the answers expire at `until` (s) at the latest."""
        value = ("1" if ok else "0") + json.dumps(answer)
        r = await self._scripts["batch_record"](
            keys=[keys.batch_results(tenant, bid), keys.batch(tenant, bid)],
            args=[idx, value, "completed" if ok else "failed", until],
        )
        return bool(int(r[0])), int(r[1]), int(r[2])

    async def stored_bytes(self, tenant: str) -> int:
        """Bytes the tenant's live files take now (inputs, outputs, uploads under way)."""
        live = await self.redis.zrangebyscore(keys.batch_files(tenant), time.time(), "+inf")
        sizes = await self.redis.hmget(keys.batch_usage(tenant), live) if live else []
        return sum(int(v) for v in sizes if v is not None)

    async def forget_answers(self, tenant: str, bid: str) -> None:
        """The output file is committed: the answers it holds leave Redis."""
        await self.redis.delete(keys.batch_results(tenant, bid))

    async def answered(self, tenant: str, bid: str, idx: int) -> bool:
        return bool(await self.redis.hexists(keys.batch_results(tenant, bid), idx))

    async def answers(self, tenant: str, bid: str, lo: int, hi: int) -> list[str | None]:
        """Lines lo..hi-1's answers ("1"|"0" + JSON), None where not yet recorded."""
        raw = await self.redis.hmget(keys.batch_results(tenant, bid), list(range(lo, hi)))
        return [text(r) if r is not None else None for r in raw]


class PartWriter:
    """Writes a file part by part as bytes come: at most one part is held."""

    def __init__(self, store: BatchStore, tenant: str, fid: str) -> None:
        self.store, self.tenant, self.fid = store, tenant, fid
        self.buf = bytearray()
        self.parts = 0
        self.size = 0

    async def write(self, data: bytes) -> None:
        self.buf += data
        self.size += len(data)
        while len(self.buf) >= self.store.part_bytes:
            await self._flush(self.store.part_bytes)

    async def close(self) -> None:
        if self.buf or self.parts == 0:
            await self._flush(len(self.buf))

    async def _flush(self, n: int) -> None:
        await self.store.put_part(self.tenant, self.fid, self.parts, bytes(self.buf[:n]))
        del self.buf[:n]
        self.parts += 1


def file_object(fid: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": fid,
        "object": "file",
        "bytes": int(meta["bytes"]),
        "created_at": int(meta["created_at"]),
        "expires_at": int(meta["expires_at"]),
        "filename": meta["filename"],
        "purpose": meta["purpose"],
        "status": "processed",
    }


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
