"""The OpenAI Batch API on the sidecar: /v1/files and /v1/batches.

The edge authenticates the API key like every other call and forwards these requests with the
tenant in `X-Admission-Tenant`; like /admit they are served on the unix socket only (the
socket's permissions are the trust boundary). Every object is scoped to its tenant: another
tenant's id answers 404, as an unknown one does.

Bounds (policy `batch:`): file bytes (413), lines per file (400), batches not yet finished per
tenant (429 `too_many_open_batches`, checked and taken in one script), files and bytes stored
per tenant (429 `too_many_files`, 413 `storage_quota_exceeded`), uploads a minute (429
`uploads_per_min`). An upload streams into Redis part by part and is validated as it comes, off
the event loop: one JSON object per line (lines end at "\n" only: JSON allows U+2028 raw in
strings) with a unique `custom_id`, `method: POST`, `url` /v1/chat/completions or
/v1/completions and a `body` object; the first problem is reported with its line number. Files
live `expires_after` (OpenAI's multipart fields) or `batch.file_ttl_s`; DELETE removes one not
read by an open batch. Batch storage unavailable: 503 `batch_storage_unavailable`.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import BodyPartReader, web

from admission.batch.lines import URLS, Lines, expires_after
from admission.batch.store import TERMINAL, BatchStore, PartWriter, batch_object, file_object
from admission.errors import BackendUnavailable, BadRequest, NotFound, PayloadTooLarge, Throttled
from admission.store import is_down
from admission.trust import Access

ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
FEED_BYTES = 1 << 20  # bytes of an upload validated per step (in a thread)


class BatchApi:
    """The handlers, over the running policy, the trust model and (once Redis is open) the
    store."""

    def __init__(self, holder: Any, access: Access) -> None:
        self.holder = holder
        self.access = access
        self.store: BatchStore

    def _tenant(self, request: web.Request) -> str:
        self.access.check_edge(request)
        tid = request.headers.get("X-Admission-Tenant", "")
        if tid not in self.holder.current.tenants:
            raise BadRequest(
                "no tenant on the request (it must come through the edge)", code="missing_tenant"
            )
        return tid

    async def upload(self, request: web.Request) -> web.Response:
        tid = self._tenant(request)
        settings = self.holder.current.batch
        limit = settings.max_file_bytes
        if not request.content_type.startswith("multipart/"):
            raise BadRequest(
                "expected multipart/form-data with `purpose` and `file`", code="invalid_request"
            )
        fid = "file-" + secrets.token_hex(12)
        await self.store.begin_upload(
            tid, fid, min(request.content_length or limit, limit), settings
        )
        writer = PartWriter(self.store, tid, fid)
        try:
            return await self._receive(request, tid, fid, writer)
        except BaseException:
            try:  # what was stored goes; the reservation too
                await asyncio.shield(self.store.abort_upload(tid, fid, writer.parts))
            except Exception:  # Redis away: the parts expire, the reservation lapses
                pass
            raise

    async def _receive(
        self, request: web.Request, tid: str, fid: str, writer: PartWriter
    ) -> web.Response:
        settings = self.holder.current.batch
        limit = settings.max_file_bytes
        lines = Lines(settings.max_lines)
        purpose, name, got_file, fields = None, "upload.jsonl", False, {}
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue  # a nested multipart: not ours
            if part.name == "file":
                name, got_file = (part.filename or name)[:256], True
                pending = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    if writer.size + len(chunk) > limit:
                        raise PayloadTooLarge(
                            f"file larger than {limit} bytes (batch.max_file_bytes)",
                            code="file_too_large",
                        )
                    await writer.write(chunk)
                    pending += chunk
                    if len(pending) >= FEED_BYTES:  # validated off the event loop
                        await asyncio.to_thread(lines.feed, bytes(pending))
                        pending.clear()
                await asyncio.to_thread(lines.feed, bytes(pending), True)
            elif part.name:
                value = (await part.read(decode=True)).decode(errors="replace")[:64]
                if part.name == "purpose":
                    purpose = value
                elif part.name.startswith("expires_after["):
                    fields[part.name] = value
        if purpose != "batch":
            raise BadRequest("purpose must be 'batch'", code="invalid_purpose")
        if not got_file:
            raise BadRequest("no `file` part", code="invalid_request")
        life = expires_after(fields, settings.file_ttl_s)
        await writer.close()
        now = int(time.time())
        # What a batch needs to know of its input (checked here, once): no re-read at create.
        meta = {
            "filename": name,
            "bytes": writer.size,
            "purpose": "batch",
            "created_at": now,
            "expires_at": now + life,
            "parts": writer.parts,
            "lines": lines.count,
            "urls": ",".join(sorted(lines.urls)),
        }
        return web.json_response(await self.store.commit_file(tid, fid, meta, bytes(lines.index)))

    async def list_files(self, request: web.Request) -> web.Response:
        tid = self._tenant(request)
        data = await self.store.list_files(tid)
        if purpose := request.query.get("purpose"):
            data = [f for f in data if f["purpose"] == purpose]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def get_file(self, request: web.Request) -> web.Response:
        fid, meta = await self._own_file(request)
        return web.json_response(file_object(fid, meta))

    async def file_content(self, request: web.Request) -> web.Response:
        fid, meta = await self._own_file(request)
        tid = self._tenant(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = int(meta["bytes"])
        await resp.prepare(request)
        async for part in self.store.file_parts(tid, fid, int(meta.get("parts", 0))):
            await resp.write(part)  # one part in memory at a time
        await resp.write_eof()
        return resp  # type: ignore[return-value]

    async def delete_file(self, request: web.Request) -> web.Response:
        fid, _meta = await self._own_file(request)
        r = await self.store.delete_file(self._tenant(request), fid)
        if r == 0:
            raise NotFound(f"no file {fid!r}", code="not_found")
        if r < 0:
            raise BadRequest(
                f"file {fid!r} is the input of an open batch: cancel it first", code="file_in_use"
            )
        return web.json_response({"id": fid, "object": "file", "deleted": True})

    async def create_batch(self, request: web.Request) -> web.Response:
        tid = self._tenant(request)
        policy = self.holder.current
        st = self.store
        try:
            body = await request.json()
        except ValueError:
            raise BadRequest("body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object", code="invalid_json")
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise BadRequest("completion_window must be '24h'", code="invalid_request")
        if endpoint not in URLS:
            raise BadRequest(f"endpoint must be one of {', '.join(URLS)}", code="invalid_request")
        meta = await st.file_meta(tid, fid) if isinstance(fid, str) and ID.fullmatch(fid) else None
        if meta is None or meta.get("purpose") != "batch":
            raise NotFound(f"no input file {fid!r}", code="not_found")
        n_lines = await self._fits(tid, meta, endpoint, policy)
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise BadRequest("metadata must be an object", code="invalid_request")
        bid = "batch_" + secrets.token_hex(12)
        now = int(time.time())
        fields = {
            "tenant": tid,
            "status": "in_progress",
            "endpoint": endpoint,
            "input_file_id": fid,
            "completion_window": "24h",
            "created_at": now,
            "in_progress_at": now,
            "expires_at": now + 24 * 3600,
            "metadata": json.dumps(metadata or {}),
            "total": n_lines,
            "completed": 0,
            "failed": 0,
            "queued": 0,
        }
        made = await st.create(tid, bid, fields, meta, policy.batch.max_open_per_tenant)
        if made == -1:
            raise NotFound(f"no input file {fid!r}", code="not_found")
        if made == 0:
            raise Throttled(
                "too_many_open_batches",
                60.0,
                f"{policy.batch.max_open_per_tenant} batches already open "
                "(batch.max_open_per_tenant)",
            )
        await st.enqueue(tid, bid, n_lines)  # cut short, the workers' sweep finishes it
        return web.json_response(
            batch_object(bid, {k: str(v) for k, v in fields.items()} | {"total": str(n_lines)})
        )

    async def _fits(self, tid: str, meta: dict[str, Any], endpoint: Any, policy: Any) -> int:
        """The input file's line count, once its lines' url, its size and the tenant's quota
        allow the batch (BadRequest, PayloadTooLarge otherwise)."""
        n_lines = int(meta.get("lines", 0))
        if meta.get("urls") != endpoint:
            raise BadRequest(
                "every line's url must be the batch's endpoint", code="invalid_request"
            )
        if n_lines > policy.batch.max_lines:  # the bound was lowered since the upload
            raise BadRequest(
                f"more than {policy.batch.max_lines} lines (batch.max_lines)", code="too_many_lines"
            )
        # The output files count against the tenant's quota too: a batch whose output (estimated
        # as large as its input) would not fit is refused now, not after its lines ran.
        stored = await self.store.stored_bytes(tid)
        quota = policy.batch.max_stored_bytes_per_tenant
        if stored + int(meta.get("bytes", 0)) > quota:
            raise PayloadTooLarge(
                f"{stored} of {quota} bytes stored and this batch's output may need "
                f"{int(meta.get('bytes', 0))} more (batch.max_stored_bytes_per_tenant): "
                "delete files first",
                code="storage_quota_exceeded",
            )
        return n_lines

    async def get_batch(self, request: web.Request) -> web.Response:
        bid, b = await self._own_batch(request)
        return web.json_response(batch_object(bid, b))

    async def list_batches(self, request: web.Request) -> web.Response:
        tid = self._tenant(request)
        st = self.store
        try:
            limit = max(1, min(100, int(request.query.get("limit", "20"))))
        except ValueError:
            raise BadRequest("limit must be an integer", code="invalid_request") from None
        ids = await st.batch_ids(tid, request.query.get("after"), limit + 1)
        data = []
        for bid in ids[:limit]:
            if (b := await st.get(tid, bid)) is not None:
                data.append(batch_object(bid, b))
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(ids) > limit,
            }
        )

    async def cancel_batch(self, request: web.Request) -> web.Response:
        bid, b = await self._own_batch(request)
        st, tid = self.store, self._tenant(request)
        if b.get("status") not in TERMINAL:
            await st.set_status(tid, bid, "cancelling", only_if=("validating", "in_progress"))
        b = await st.get(tid, bid) or b
        return web.json_response(batch_object(bid, b))

    async def _own(self, request: web.Request, key: str, load: Any) -> tuple[str, dict[str, Any]]:
        """The object named by `request.match_info[key]` (loaded by `load`) among the caller's
        tenant's: another tenant's is as absent as a missing one (404), and so is a name that
        cannot be an id."""
        tid = self._tenant(request)
        oid = request.match_info[key]
        obj = await load(tid, oid) if ID.fullmatch(oid) else None
        if obj is None:
            raise NotFound(f"no {key.removesuffix('_id')} {oid!r}", code="not_found")
        return oid, obj

    async def _own_file(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        return await self._own(request, "file_id", self.store.file_meta)

    async def _own_batch(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        return await self._own(request, "batch_id", self.store.get)

    def add_routes(self, app: web.Application) -> None:
        for method, path, handler in (
            ("POST", "/v1/files", self.upload),
            ("GET", "/v1/files", self.list_files),
            ("GET", "/v1/files/{file_id}", self.get_file),
            ("DELETE", "/v1/files/{file_id}", self.delete_file),
            ("GET", "/v1/files/{file_id}/content", self.file_content),
            ("POST", "/v1/batches", self.create_batch),
            ("GET", "/v1/batches", self.list_batches),
            ("GET", "/v1/batches/{batch_id}", self.get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", self.cancel_batch),
        ):
            app.router.add_route(method, path, _storage_guard(handler))


def _storage_guard(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Batch storage that cannot serve (down, READONLY, OOM, a cluster slot uncovered): 503
    with a reason, not a 500."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            if is_down(exc):
                raise BackendUnavailable(
                    "batch storage unavailable", code="batch_storage_unavailable"
                ) from exc
            raise

    return guarded
