"""The Redis Lua scripts (store/lua/*.lua), loaded once, run alone or several per round trip.

A round trip costs the sidecar ~100-170 µs of CPU in redis-py, the largest share of an
admission, so calls that belong together (acquire + node lease on the fast path; lease
release + settle) go in one non-transactional pipeline — and so do the calls of every admission
and release that arrive while a round trip is out: one round trip is in flight at a time, and
whatever queued meanwhile leaves together in the next (up to `MAX_BATCH` calls). At low load
that is one round trip per admission, as before; under load the per-round-trip cost (pool,
pipeline, syscalls — in redis-server too) is shared by everything that waited. Each script keeps
its own hash tag, so on Redis Cluster (no pipelines of scripts there) calls run concurrently and
every script stays atomic. NOSCRIPT (after a restart or SCRIPT FLUSH) loads the scripts again and
retries once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rex

from admission.store.connection import is_down, on_cluster, raise_if_down

NAMES = ("acquire", "settle", "lease", "unlease", "pending_clamp")
# A caller's compensations, built only if it was cancelled (the client left) while its calls
# were out: they ran anyway, so what they took is given back in the next round trip.
Orphan = Callable[[], tuple["Call", ...]] | None
MAX_BATCH = 512  # calls per coalesced round trip


def _lua(name: str) -> str:
    return resources.files("admission.store").joinpath(f"lua/{name}.lua").read_text()


# Time and bucket arithmetic, written once for every script (see lua/prelude.lua).
PRELUDE = _lua("prelude")


@dataclass(frozen=True)
class Call:
    """One command of a batch: a script (by name) or a plain Redis command (`script=None`)."""

    script: str | None
    keys: list[str] | list[bytes]
    args: list[Any]


class Scripts:
    def __init__(
        self,
        redis: Any,
        timeout_s: float | None = None,
        observe: Callable[[float], None] = lambda _s: None,
    ) -> None:
        self.redis = redis
        self.timeout_s = timeout_s  # per round trip (a client without per-reply timeouts)
        self.observe = observe  # seconds of each coalesced round trip that answered
        # When (time.monotonic) Redis last answered a round trip with something other than
        # "unavailable": the node views' failure mode asks it (nodetable.py).
        self.answered_at = -1e9
        # redis-py refuses EVALSHA in cluster pipelines: there, calls run concurrently instead.
        self.cluster = isinstance(redis, aioredis.RedisCluster)
        self.source = {n: PRELUDE + _lua(n) for n in NAMES}
        self.sha = {n: hashlib.sha1(src.encode()).hexdigest() for n, src in self.source.items()}
        # (calls, the caller's future or None, what to send if the caller left meanwhile)
        self._waiting: list[tuple[tuple[Call, ...], asyncio.Future[list[Any]] | None, Orphan]] = []
        self._sending: asyncio.Task[None] | None = None
        self._compensating: set[asyncio.Task[None]] = set()  # Cluster: see `_after`

    async def run(self, *calls: Call, orphan: Orphan = None) -> list[Any]:
        """Run `calls` in one round trip (shared with other callers'); return their results in
        order (errors as exceptions for script errors, raised for connection problems).
        `orphan`: the compensations to send if this caller is cancelled before the answer."""
        if self.cluster:
            started = time.perf_counter()
            # Shielded: a caller cancelled (the client left) must not cut the calls off half
            # sent; they run to their end, then its compensations go (as `_send` does).
            out = asyncio.ensure_future(self._run(calls))
            try:
                results = await asyncio.shield(out)
            except asyncio.CancelledError:
                if orphan is not None:
                    self._after(out, orphan)
                raise
            self.observe(time.perf_counter() - started)
            self._answered(results)
            raise_if_down(results)
            return results
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._enqueue(calls, fut, orphan)
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled after its reply came but before it resumed (the reply and the cancel in
            # the same loop turn): the calls ran, and only the orphan can undo them now.
            if orphan is not None and fut.done() and not fut.cancelled() and not fut.exception():
                self._enqueue(orphan(), None, None)
            raise

    def _answered(self, results: list[Any]) -> None:
        if not all(is_down(r) for r in results):
            self.answered_at = time.monotonic()

    def _after(
        self, out: asyncio.Future[list[Any]], orphan: Callable[[], tuple[Call, ...]]
    ) -> None:
        """Redis Cluster: send `orphan`'s compensations once the round trip `out` has ended
        (whether or not it ran: they are idempotent). Lost if Redis fails them, as in `_send`;
        the TTLs free what they held, later."""

        async def compensate() -> None:
            with contextlib.suppress(Exception):
                await out
            with contextlib.suppress(Exception):
                await self._run(orphan())

        task = asyncio.ensure_future(compensate())
        self._compensating.add(task)
        task.add_done_callback(self._compensating.discard)

    def _enqueue(
        self, calls: tuple[Call, ...], fut: asyncio.Future[list[Any]] | None, orphan: Orphan
    ) -> None:
        self._waiting.append((calls, fut, orphan))
        if self._sending is None:
            self._sending = asyncio.create_task(self._send(), name="redis-round-trips")

    async def _send(self) -> None:
        """Send what waits, one round trip at a time, until nothing does."""
        try:
            while self._waiting:
                n = k = 0
                while k < len(self._waiting) and n < MAX_BATCH:  # calls, not callers
                    n += len(self._waiting[k][0])
                    k += 1
                group, self._waiting = self._waiting[:k], self._waiting[k:]
                failed: BaseException | None = None
                started = time.perf_counter()
                try:
                    async with asyncio.timeout(self.timeout_s):
                        results = await self._run(
                            tuple(c for calls, _f, _o in group for c in calls)
                        )
                    self.observe(time.perf_counter() - started)
                    self._answered(results)
                except TimeoutError:  # redis-py dropped the connection mid-reply
                    failed = rex.TimeoutError("Redis round trip timed out")
                except asyncio.CancelledError:
                    for _calls, f, _o in group:
                        if f is not None:
                            f.cancel()
                    raise
                except Exception as exc:
                    failed = exc
                i = 0
                for calls, f, orphan in group:
                    mine, i = (None, i) if failed else (results[i : i + len(calls)], i + len(calls))
                    if f is None:  # compensations nobody waits for
                        continue
                    if f.done():  # its caller is gone (cancelled), its calls may have run
                        if orphan is not None:
                            self._waiting.append((orphan(), None, None))
                    elif mine is None:
                        f.set_exception(failed)  # type: ignore[arg-type]
                    else:
                        try:
                            raise_if_down(mine)
                            f.set_result(mine)
                        except Exception as exc:
                            f.set_exception(exc)
        finally:
            self._sending = None
            for _calls, f, _o in self._waiting:  # stopped (cancelled) with callers still waiting
                if f is not None and not f.done():
                    f.set_exception(rex.ConnectionError("the round trip was stopped"))
            self._waiting = []

    async def _run(self, calls: tuple[Call, ...]) -> list[Any]:
        """One round trip. On NOSCRIPT every script is loaded again and only the calls that
        failed with it run again: a call that did run (another process had reloaded its script)
        must not run twice."""
        results = await self._batch(calls)
        missing = [i for i, r in enumerate(results) if isinstance(r, rex.NoScriptError)]
        if missing:
            for name in NAMES:
                await self.redis.script_load(self.source[name])
            again = await self._batch(tuple(calls[i] for i in missing))
            for i, r in zip(missing, again, strict=True):
                results[i] = r
        return results

    async def _batch(self, calls: tuple[Call, ...]) -> list[Any]:
        if self.cluster:
            out = await asyncio.gather(*(self._one(c) for c in calls), return_exceptions=True)
            # A call cancelled under us (redis-py closing a connection another call was reading,
            # while it re-reads the layout; the round trip itself is shielded from its caller's
            # cancel): a lost connection, which may have run — not a reply (it reached the
            # limiter as one: TypeError, a 500, 1 run in 20 of tests/test_many_sidecars.py).
            return [_lost(r) if isinstance(r, asyncio.CancelledError) else r for r in out]
        return await self._pipeline(calls)

    async def _one(self, c: Call) -> Any:
        if c.script is None:
            return await on_cluster(self.redis, lambda: self.redis.execute_command(*c.args))
        sha = self.sha[c.script]
        return await on_cluster(
            self.redis, lambda: self.redis.evalsha(sha, len(c.keys), *c.keys, *c.args)
        )

    async def _pipeline(self, calls: tuple[Call, ...]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        sha = self.sha
        for c in calls:  # EVALSHA as a plain command: redis-py's wrapper costs a call per call
            if c.script is None:
                pipe.execute_command(*c.args)
            else:
                pipe.execute_command("EVALSHA", sha[c.script], len(c.keys), *c.keys, *c.args)
        return list(await pipe.execute(raise_on_error=False))


def _lost(exc: asyncio.CancelledError) -> rex.ConnectionError:
    lost = rex.ConnectionError("call cancelled under the round trip: its connection closed")
    lost.__cause__ = exc
    return lost
