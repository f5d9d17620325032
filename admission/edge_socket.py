"""The edge's own way to ask for admissions: JSON lines on a unix socket.

Every admission used to be an HTTP request to the sidecar (an NGINX subrequest, aiohttp's
parsing, routing, middlewares and response writing): more than half of the sidecar's CPU per
request went there, not into the decision. On this socket NGINX's Lua keeps pooled connections
(cosockets) and writes one line per ask — the same JSON object `/admit` takes — and reads one
line back: `{"status": 200, "body": {…}}`, or an error's status, body and Retry-After, exactly
as `/admit` answers. One ask at a time per connection; a connection that closes while its ask
waits (the client went away, NGINX aborted the request) cancels it, which frees its queue
slot, as a dropped HTTP request does. Unix socket only (its file mode is the boundary, like the
HTTP socket's); `/admit` stays for tools and tests.

An ask with `"ack": true` is acknowledged by the edge with a line `+` once it has read the
answer. A connection that closes before the `+` of an admission (NGINX aborted the request
after the sidecar wrote its answer, so no release will ever come) gives that lease back at
once, with nothing charged: it no longer waits out `lease_ttl_s`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from typing import Any

import orjson
from aiohttp import web

from admission.answer import DECIDER, error_body
from admission.errors import AdmissionError, BadRequest

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024  # as /admit's body limit
ACK = b"+"  # the edge read the answer
ACK_ASKED = re.compile(rb'"ack"\s*:\s*true')
GIVING_BACK: set[asyncio.Future[None]] = set()  # leases of answers nobody read, going back
TOO_LARGE = b"\x00too large"  # marks an ask cut off at MAX_LINE (compared by identity)


class EdgeProtocol(asyncio.Protocol):
    def __init__(self, app: web.Application, live: set[EdgeProtocol]) -> None:
        self.app = app
        self.live = live
        self.buf = bytearray()
        self.asks: deque[bytes] = deque()
        self.task: asyncio.Task[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.unacked: str | None = None  # the ticket of an answer the edge has not confirmed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.live.add(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (i := self.buf.find(b"\n")) >= 0:
            line = bytes(self.buf[:i]) if i <= MAX_LINE else TOO_LARGE
            del self.buf[: i + 1]
            if line == ACK:
                self.unacked = None
                continue
            self.unacked = None  # a new ask: the last answer was read
            self.asks.append(line)
        if len(self.buf) > MAX_LINE:
            self.asks.append(TOO_LARGE)  # answered 400, then the connection is closed
            self.buf.clear()
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.live.discard(self)
        self.asks.clear()
        if self.task is not None:
            self.task.cancel()
        if (ticket := self.unacked) is not None:
            self.unacked = None
            task = asyncio.ensure_future(self._unanswered(ticket))
            GIVING_BACK.add(task)
            task.add_done_callback(GIVING_BACK.discard)

    async def _unanswered(self, ticket: str) -> None:
        log.warning("admission %s: the edge left before reading it; lease given back", ticket)
        try:
            await self.app[DECIDER].dispatcher.release(ticket, 0)  # the engine never saw it
        except Exception as exc:  # Redis away: the lease expires at lease_ttl_s
            log.warning("admission %s: lease not given back (%r)", ticket, exc)

    def _next(self) -> None:
        if self.task is None and self.asks:
            ask = self.asks.popleft()
            self.task = asyncio.create_task(self._answer(ask))
            self.task.add_done_callback(self._done)

    def _done(self, _t: asyncio.Task[None]) -> None:
        self.task = None
        if self.transport is not None and not self.transport.is_closing():
            self._next()

    async def _answer(self, ask: bytes) -> None:
        try:
            if ask is TOO_LARGE:
                raise BadRequest(f"an ask is at most {MAX_LINE} bytes", code="body_too_large")
            out: dict[str, Any] = {"status": 200, "body": await self.app[DECIDER].decide(ask)}
            if ACK_ASKED.search(ask):
                self.unacked = out["body"]["ticket"]
        except AdmissionError as exc:
            out = {"status": exc.status, "body": error_body(exc)}
            if exc.ratelimit:
                out["ratelimit"] = exc.ratelimit
            if (ra := exc.retry_after_s()) is not None:
                out["retry_after"] = ra
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("admission failed")
            out = {
                "status": 500,
                "body": {
                    "error": {
                        "message": "internal error",
                        "type": "server_error",
                        "code": "internal",
                    }
                },
            }
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(orjson.dumps(out) + b"\n")
            if ask is TOO_LARGE:  # the rest of that line is still coming: no way to resync
                self.transport.close()


async def serve(
    app: web.Application, path: str, backlog: int
) -> tuple[asyncio.Server, set[EdgeProtocol]]:
    """Listen on `path`; returns the server and its live connections (to drain on stop)."""
    live: set[EdgeProtocol] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: EdgeProtocol(app, live), path, backlog=backlog)
    return server, live


async def drain(server: asyncio.Server, live: set[EdgeProtocol], timeout_s: float) -> None:
    """Stop taking connections; let asks in flight finish for up to `timeout_s`."""
    server.close()
    tasks = [p.task for p in live if p.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
    for p in list(live):
        if p.transport is not None:
            p.transport.close()
