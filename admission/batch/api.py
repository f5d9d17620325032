"""The OpenAI Batch API on the sidecar: /v1/files and /v1/batches.

The edge authenticates the API key like every other call and forwards these requests with the
tenant in `X-Admission-Tenant`; like /admit they are served on the unix socket only (the
socket's permissions are the trust boundary). Every object is scoped to its tenant: another
tenant's id answers 404, as an unknown one does.

Bounds (policy `batch:`): file bytes (413), lines per file (400), batches not yet finished per
tenant (429 `too_many_open_batches`). Lines are validated at upload: one JSON object per line
with a unique `custom_id`, `method: POST`, `url` /v1/chat/completions or /v1/completions and a
`body` object; the first problem is reported with its line number.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from aiohttp import BodyPartReader, web

from admission.access import Access
from admission.batch.store import TERMINAL, BatchStore, batch_object, file_object
from admission.errors import BadRequest, NotFound, PayloadTooLarge, Throttled

URLS = ("/v1/chat/completions", "/v1/completions")


def parse_lines(data: bytes, max_lines: int) -> list[dict[str, Any]]:
    """The requests of a batch input file; BadRequest naming the first bad line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"file is not UTF-8 (byte {exc.start})", code="invalid_file") from None
    lines, seen = [], set()
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            raise BadRequest(f"line {n}: not JSON", code="invalid_file") from None
        if not isinstance(obj, dict):
            raise BadRequest(f"line {n}: not a JSON object", code="invalid_file")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > 512:
            raise BadRequest(f"line {n}: custom_id must be a non-empty string", code="invalid_file")
        if cid in seen:
            raise BadRequest(f"line {n}: custom_id {cid!r} repeats", code="invalid_file")
        seen.add(cid)
        if obj.get("method") != "POST" or obj.get("url") not in URLS:
            raise BadRequest(f"line {n}: method must be POST and url one of {', '.join(URLS)}",
                             code="invalid_file")  # fmt: skip
        if not isinstance(obj.get("body"), dict):
            raise BadRequest(f"line {n}: body must be an object", code="invalid_file")
        lines.append(obj)
        if len(lines) > max_lines:
            raise BadRequest(
                f"more than {max_lines} lines (batch.max_lines)", code="too_many_lines"
            )
    if not lines:
        raise BadRequest("file has no requests", code="invalid_file")
    return lines


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
            raise BadRequest("no tenant on the request (it must come through the edge)",
                             code="missing_tenant")  # fmt: skip
        return tid

    async def upload(self, request: web.Request) -> web.Response:
        tid = self._tenant(request)
        policy = self.holder.current
        limit = policy.batch.max_file_bytes
        if not request.content_type.startswith("multipart/"):
            raise BadRequest(
                "expected multipart/form-data with `purpose` and `file`", code="invalid_request"
            )
        reader = await request.multipart()
        purpose, name, data = None, "upload.jsonl", None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue  # a nested multipart: not ours
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode(errors="replace")[:64]
            elif part.name == "file":
                name = (part.filename or name)[:256]
                buf = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    buf += chunk
                    if len(buf) > limit:
                        raise PayloadTooLarge(f"file larger than {limit} bytes (batch.max_file_bytes)",
                                       code="file_too_large")  # fmt: skip
                data = bytes(buf)
        if purpose != "batch":
            raise BadRequest("purpose must be 'batch'", code="invalid_purpose")
        if data is None:
            raise BadRequest("no `file` part", code="invalid_request")
        lines = parse_lines(data, policy.batch.max_lines)
        fid = "file-" + secrets.token_hex(12)
        # What a batch needs to know of its input (checked here, once): no re-read at create.
        urls = ",".join(sorted({ln["url"] for ln in lines}))
        obj = await self.store.put_file(fid, tid, name, "batch", data, lines=len(lines), urls=urls)
        return web.json_response(obj)

    async def get_file(self, request: web.Request) -> web.Response:
        fid, meta = await self._own_file(request)
        return web.json_response(file_object(fid, meta))

    async def file_content(self, request: web.Request) -> web.Response:
        fid, _meta = await self._own_file(request)
        data = await self.store.file_bytes(fid)
        if data is None:
            raise NotFound(f"no content for file {fid!r}", code="not_found")
        return web.Response(body=data, content_type="application/octet-stream")

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
        meta = await st.file_meta(fid) if isinstance(fid, str) else None
        if meta is None or meta.get("tenant") != tid or meta.get("purpose") != "batch":
            raise NotFound(f"no input file {fid!r}", code="not_found")
        n_lines = int(meta.get("lines", 0))
        if meta.get("urls") != endpoint:
            raise BadRequest(
                "every line's url must be the batch's endpoint", code="invalid_request"
            )
        if n_lines > policy.batch.max_lines:  # the bound was lowered since the upload
            raise BadRequest(f"more than {policy.batch.max_lines} lines (batch.max_lines)",
                             code="too_many_lines")  # fmt: skip
        if await st.open_count(tid) >= policy.batch.max_open_per_tenant:
            raise Throttled("too_many_open_batches", 60.0,
                            f"{policy.batch.max_open_per_tenant} batches already open "
                            "(batch.max_open_per_tenant)")  # fmt: skip
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise BadRequest("metadata must be an object", code="invalid_request")
        bid = "batch_" + secrets.token_hex(12)
        now = int(time.time())
        fields = {"tenant": tid, "status": "in_progress", "endpoint": endpoint, "input_file_id": fid,
                  "completion_window": "24h", "created_at": now, "in_progress_at": now,
                  "expires_at": now + 24 * 3600, "metadata": json.dumps(metadata or {})}  # fmt: skip
        await st.create(bid, tid, fields, n_lines)
        return web.json_response(batch_object(bid, {k: str(v) for k, v in fields.items()}
                                              | {"total": str(n_lines)}))  # fmt: skip

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
        ids = await st.list(tid, request.query.get("after"), limit + 1)
        data = []
        for bid in ids[:limit]:
            if (b := await st.get(bid)) is not None:
                data.append(batch_object(bid, b))
        return web.json_response({"object": "list", "data": data,
                                  "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None,
                                  "has_more": len(ids) > limit})  # fmt: skip

    async def cancel_batch(self, request: web.Request) -> web.Response:
        bid, b = await self._own_batch(request)
        st = self.store
        if b.get("status") not in TERMINAL:
            await st.set_status(bid, "cancelling", only_if=("validating", "in_progress"))
        b = await st.get(bid) or b
        return web.json_response(batch_object(bid, b))

    async def _own(self, request: web.Request, key: str, load: Any) -> tuple[str, dict[str, Any]]:
        """The object named by `request.match_info[key]` (loaded by `load`), if the caller's
        tenant owns it; another tenant's is as absent as a missing one (404)."""
        tid = self._tenant(request)
        oid = request.match_info[key]
        obj = await load(oid)
        if obj is None or obj.get("tenant") != tid:
            raise NotFound(f"no {key.removesuffix('_id')} {oid!r}", code="not_found")
        return oid, obj

    async def _own_file(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        return await self._own(request, "file_id", self.store.file_meta)

    async def _own_batch(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        return await self._own(request, "batch_id", self.store.get)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files/{file_id}", self.get_file)
        app.router.add_get("/v1/files/{file_id}/content", self.file_content)
        app.router.add_post("/v1/batches", self.create_batch)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{batch_id}", self.get_batch)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel_batch)
