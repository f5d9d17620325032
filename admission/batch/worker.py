"""`admission batch-worker`: runs the lines of OpenAI batches through the edge.

Each worker is a consumer of the `workers` group on the line stream. A line goes through the
edge's internal unix socket, where the tenant is named by `X-Admission-Batch-Tenant` instead of
an API key, at the tenant's batch class (`batch.line_class`, or its least urgent class): its
limits, weights and the node watermarks apply, so batch work fills idle capacity and yields to
realtime. Retryable refusals (429, 502/503/504, no answer) are retried with the Retry-After or
a backoff, up to `batch.max_attempts`; other answers are final.

Exactly once: a line's answer is recorded with HSETNX by line index, then the stream entry is
acknowledged. A worker that dies leaves its entries pending; after `CLAIM_IDLE_S` without its
heartbeat another worker claims them (XAUTOCLAIM), finds any answer already recorded and only
acknowledges, or runs the line. The worker recording a batch's last answer finalizes it (output
and error files with ids derived from the batch id, so a finalize cut short is redone by the
next sweep and writes the same files).

Bounded memory: a line is read by its offsets from the input file's index (no batch's lines are
kept), and output files are written part by part as the answers are read, a thousand at a time.
A batch whose finalize fails is logged and retried at the next sweep; the others go on.

One job over 350 lines: a batch line's life from claim to answer, its retries and its
sweep; the pace and the Redis state are modules of their own (pace.py, store.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from typing import Any

import aiohttp

from admission.batch.pace import Pace
from admission.batch.store import GROUP, OPEN, STREAM, TERMINAL, BatchStore, PartWriter, text
from admission.policy import Policy

log = logging.getLogger(__name__)

CLAIM_IDLE_S = 30.0  # an entry pending this long without its worker's heartbeat is taken over
SWEEP_S = 5.0  # heartbeat, reclaim and finalize sweep period
ENQUEUE_AFTER_S = 30.0  # a batch whose lines are not all queued this long after its creation:
# the sidecar that created it died midway, and the sweep queues the rest
RETRYABLE = (0, 429, 500, 502, 503, 504)
# One line's answer is read as it comes, up to this: past it (n, logprobs and a large max_tokens
# can make hundreds of MB) the line fails with `answer_too_large` and the worker lives on.
MAX_ANSWER_BYTES = 16 << 20
# A line taken over this many times (its workers died on it: a poison line) is set aside with
# an error answer instead of being taken over again forever.
MAX_DELIVERIES = 5


class Worker:
    def __init__(
        self,
        redis: Any,
        policy: Any,
        edge_socket: str,
        concurrency: int = 16,
        claim_idle_s: float = CLAIM_IDLE_S,
    ) -> None:
        self.redis = redis
        self.policy = policy  # callable → Policy
        self.store = BatchStore(redis)
        self.edge_socket = edge_socket
        self.pace = Pace(concurrency)  # lines in flight: up to `concurrency`, as the cluster allows
        self.claim_idle_s = claim_idle_s
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.inflight: dict[str, asyncio.Task[None]] = {}  # stream entry id → its task

    async def run(self, stop: asyncio.Event) -> None:
        await self.store.ensure_group()
        conn = aiohttp.UnixConnector(path=self.edge_socket, limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=1200)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as self.http:
            next_sweep = 0.0
            while not stop.is_set():
                try:
                    if time.monotonic() >= next_sweep:
                        await self.sweep()
                        next_sweep = time.monotonic() + SWEEP_S
                    await self.take(block_ms=500)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis away, a malformed entry...: log, wait, go on
                    log.warning("batch worker step failed: %r", exc)
                    await asyncio.sleep(1.0)
            for t in self.inflight.values():
                t.cancel()
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)

    async def take(self, block_ms: int) -> None:
        free = self.pace.allowed() - len(self.inflight)
        if free <= 0:
            await asyncio.sleep(0.05)
            return
        got = await self.redis.xreadgroup(
            GROUP, self.name, {STREAM: ">"}, count=free, block=block_ms
        )
        for _stream, entries in got or []:
            for eid, fields in entries:
                self._start(text(eid), fields)

    def _start(self, eid: str, fields: dict[Any, Any]) -> None:
        if eid in self.inflight:
            return
        f = {text(k): text(v) for k, v in fields.items()}
        line = self.line(eid, f.get("t", ""), f.get("b", ""), int(f.get("i", -1)))
        task = asyncio.create_task(line)
        self.inflight[eid] = task

        def done(_t: asyncio.Task[None], e: str = eid) -> None:
            self.inflight.pop(e, None)

        task.add_done_callback(done)

    async def sweep(self) -> None:
        """Heartbeat our entries, take over a dead worker's, finalize finished batches."""
        if self.inflight:
            await self.redis.xclaim(STREAM, GROUP, self.name, 0, list(self.inflight), justid=True)
        free = self.pace.allowed() - len(self.inflight)
        if free > 0:
            res = await self.redis.xautoclaim(
                STREAM, GROUP, self.name, int(self.claim_idle_s * 1000), start_id="0-0", count=free
            )
            for eid, fields in res[1]:
                if fields and await self._poison(text(eid), fields):
                    continue
                if fields:
                    log.info("batch line %s taken over from a silent worker", text(eid))
                    self._start(text(eid), fields)
        for bid, tenant in (await self.store.open_batches()).items():
            try:
                await self._check(tenant, bid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one batch's trouble must not stop the sweep for others
                log.warning("batch %s: sweep failed: %r", bid, exc)

    async def _poison(self, eid: str, fields: dict[Any, Any]) -> bool:
        """Whether a line taken over has been delivered MAX_DELIVERIES times: then its answer
        is an error (`line_failed_repeatedly`) and it is not taken over again."""
        pending = await self.redis.xpending_range(STREAM, GROUP, eid, eid, 1)
        if not pending or int(pending[0]["times_delivered"]) < MAX_DELIVERIES:
            return False
        f = {text(k): text(v) for k, v in fields.items()}
        tenant, bid, idx = f.get("t", ""), f.get("b", ""), int(f.get("i", -1))
        b = await self.store.get(tenant, bid) if tenant else None
        if b is not None and idx >= 0:
            log.warning("batch %s line %d: set aside after %d deliveries", bid, idx, MAX_DELIVERIES)
            answer = _error_line(
                f"line-{idx}", "line_failed_repeatedly", "this line stopped its worker repeatedly"
            )
            _rec, done, total = await self.store.record(
                tenant, bid, idx, answer, False, _until(b, self.policy())
            )
            if done >= total:
                await self.finalize(tenant, bid)
        await self._ack(eid)
        return True

    async def _check(self, tenant: str, bid: str) -> None:
        b = await self.store.get(tenant, bid)
        if b is None:
            await self.redis.hdel(OPEN, bid)
            return
        total = int(b.get("total", 0))
        queued = int(b.get("queued", total))
        if queued < total and time.time() - int(b.get("created_at", 0)) > ENQUEUE_AFTER_S:
            log.info("batch %s: queueing lines %d.. its sidecar did not", bid, queued)
            await self.store.enqueue(tenant, bid, total, queued)
        elif int(b.get("completed", 0)) + int(b.get("failed", 0)) >= total:
            await self.finalize(tenant, bid)

    async def line(self, eid: str, tenant: str, bid: str, idx: int) -> None:
        b = await self.store.get(tenant, bid) if tenant else None
        if b is None or idx < 0:
            await self._ack(eid)
            return
        if await self.store.answered(tenant, bid, idx):  # answered before a crash
            await self._ack(eid)
            return
        raw = await self.store.line(tenant, b["input_file_id"], idx)
        req: Any = json.loads(raw) if raw is not None else None
        cid = req["custom_id"] if isinstance(req, dict) else f"line-{idx}"
        status = b.get("status")
        if req is None:
            answer = _error_line(cid, "input_file_gone", "the input file expired or was deleted")
            ok = False
        elif status == "cancelling" or status in TERMINAL:
            answer, ok = _error_line(cid, "batch_cancelled", "the batch was cancelled"), False
        elif time.time() > int(b.get("expires_at", 0) or 0):
            answer, ok = _error_line(cid, "batch_expired", "the batch's 24 h window ended"), False
        else:
            answer, ok = await self.send(tenant, req)
        until = _until(b, self.policy())
        _recorded, done, total = await self.store.record(tenant, bid, idx, answer, ok, until)
        await self._ack(eid)
        if done >= total:
            await self.finalize(tenant, bid)

    async def send(self, tenant: str, req: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Run one request through the edge, retrying what may succeed later."""
        policy: Policy = self.policy()
        cls = _line_class(policy, tenant)
        headers = {"Content-Type": "application/json", "X-Admission-Batch-Tenant": tenant}
        if cls:
            headers["X-Request-Class"] = cls
        status, body, delay = 0, b"", 0.5
        for _attempt in range(policy.batch.max_attempts):
            t0 = time.monotonic()
            try:
                async with self.http.post(
                    f"http://edge{req['url']}", json=req["body"], headers=headers
                ) as r:
                    status, read = r.status, await _read_capped(r)
                    retry_after = r.headers.get("Retry-After")
                    if read is None:
                        return _error_line(
                            req["custom_id"],
                            "answer_too_large",
                            f"the answer passed {MAX_ANSWER_BYTES} bytes: ask for fewer choices, "
                            "logprobs or tokens",
                        ), False
                    body = read
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, body, retry_after = 0, str(exc).encode(), None
            took = time.monotonic() - t0
            if status != 200:
                self.pace.sample(took, 0, status)
            if status not in RETRYABLE:
                break
            wait = float(retry_after) if retry_after and retry_after.isdigit() else delay
            await asyncio.sleep(min(wait, 30.0))
            delay = min(delay * 2, 30.0)
        rid = "batch_req_" + secrets.token_hex(12)
        try:
            doc: Any = json.loads(body) if body else None
        except ValueError:
            doc = {"raw": body[:2000].decode(errors="replace")}
        if status == 200:
            self.pace.sample(took, _output_tokens(doc), 200)
            return {
                "id": rid,
                "custom_id": req["custom_id"],
                "response": {"status_code": 200, "request_id": rid, "body": doc},
                "error": None,
            }, True
        err = (doc or {}).get("error") if isinstance(doc, dict) else None
        code = (err or {}).get("code") if isinstance(err, dict) else None
        return {
            "id": rid,
            "custom_id": req["custom_id"],
            "response": {"status_code": status, "request_id": rid, "body": doc} if status else None,
            "error": {
                "code": code or ("no_answer" if not status else f"http_{status}"),
                "message": (err or {}).get("message", "") if isinstance(err, dict) else "",
            },
        }, False

    async def finalize(self, tenant: str, bid: str) -> None:
        """Write the output and error files (input order) and close the batch; idempotent."""
        st = self.store
        b = await st.get(tenant, bid)
        if b is None or b.get("status") in TERMINAL:
            return
        final = "cancelled" if b.get("cancelling_at") else "completed"
        await st.set_status(
            tenant, bid, "finalizing", only_if=("in_progress", "cancelling", "finalizing")
        )
        total = int(b.get("total", 0))
        out = PartWriter(st, tenant, f"file-{bid}-output")
        errs = PartWriter(st, tenant, f"file-{bid}-errors")
        counts = {"1": 0, "0": 0}
        for lo in range(0, total, 1000):
            for a in await st.answers(tenant, bid, lo, min(total, lo + 1000)):
                if a is None:
                    return  # not every line answered yet (a sweep raced a recording): later
                await (out if a[0] == "1" else errs).write(a[1:].encode() + b"\n")
                counts[a[0]] += 1
        fields: dict[str, Any] = {}
        now = int(time.time())
        life = self.policy().batch.file_ttl_s
        for w, n, field, kind in (
            (out, counts["1"], "output_file_id", "output"),
            (errs, counts["0"], "error_file_id", "errors"),
        ):
            if n:
                await w.close()
                meta = {
                    "filename": f"{bid}_{kind}.jsonl",
                    "bytes": w.size,
                    "purpose": "batch_output",
                    "created_at": now,
                    "expires_at": now + life,
                    "parts": w.parts,
                }
                await st.commit_file(tenant, w.fid, meta)
                fields[field] = w.fid
        if fields:
            await st.set_fields(tenant, bid, **fields)
        if await st.set_status(tenant, bid, final, only_if=("finalizing",)):
            log.info("batch %s %s: %d answered, %d failed", bid, final, counts["1"], counts["0"])
            await st.forget_answers(tenant, bid)  # they live on in the output files only

    async def _ack(self, eid: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(STREAM, GROUP, eid)
        pipe.xdel(STREAM, eid)
        await pipe.execute()


def _line_class(policy: Policy, tenant: str) -> str | None:
    """`batch.line_class` if the tenant may use it, else its least urgent class."""
    t = policy.tenants.get(tenant)
    if t is None:
        return None
    if policy.batch.line_class in t.classes:
        return policy.batch.line_class
    allowed = [c for c in policy.classes if c in t.classes]
    return allowed[-1] if allowed else None


def _output_tokens(doc: Any) -> int:
    """The completion tokens an answer reports (0 when it does not say)."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) else 0


def _error_line(cid: str, code: str, message: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": cid,
        "response": None,
        "error": {"code": code, "message": message},
    }


async def _read_capped(r: aiohttp.ClientResponse) -> bytes | None:
    """The body, read as it comes; None past MAX_ANSWER_BYTES (the rest is not read)."""
    parts, size = [], 0
    async for chunk in r.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _until(b: dict[str, str], policy: Policy) -> int:
    """When a batch's answers expire at the latest: its window's end and an output file's life
    (the output is written by then, and the answers deleted)."""
    return int(b.get("expires_at", 0) or time.time()) + policy.batch.file_ttl_s
