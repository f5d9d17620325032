"""The Redis Lua scripts (admission/lua/*.lua), loaded once, run alone or several per round trip.

A round trip costs the sidecar ~100-170 µs of CPU in redis-py, the largest share of an
admission, so calls that belong together (acquire + node lease on the fast path; lease
release + settle) go in one non-transactional pipeline. Each script keeps its own hash tag, so
on Redis Cluster the pipeline is split by slot and every script stays atomic. NOSCRIPT (after a
restart or SCRIPT FLUSH) loads the scripts again and retries once.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rex

NAMES = ("acquire", "settle", "lease")


@dataclass(frozen=True)
class Call:
    """One command of a batch: a script (by name) or a plain Redis command (`script=None`)."""

    script: str | None
    keys: list[str]
    args: list[Any]


class Scripts:
    def __init__(self, redis: Any) -> None:
        self.redis = redis
        # redis-py refuses EVALSHA in cluster pipelines: there, calls run concurrently instead.
        self.cluster = isinstance(redis, aioredis.RedisCluster)
        self.source = {
            n: resources.files("admission").joinpath(f"lua/{n}.lua").read_text() for n in NAMES
        }
        self.sha = {n: hashlib.sha1(src.encode()).hexdigest() for n, src in self.source.items()}

    async def run(self, *calls: Call) -> list[Any]:
        """Run `calls` in one round trip; return their results in order (errors as exceptions
        for script errors, raised for connection problems)."""
        for attempt in (0, 1):
            if self.cluster:
                results = await asyncio.gather(
                    *(self._one(c) for c in calls), return_exceptions=True
                )
            else:
                results = await self._pipeline(calls)
            if attempt == 0 and any(isinstance(r, rex.NoScriptError) for r in results):
                for c in calls:
                    if c.script is not None:
                        await self.redis.script_load(self.source[c.script])
                continue
            for r in results:
                if isinstance(r, (rex.ConnectionError, rex.TimeoutError, OSError)):
                    raise r
            return list(results)
        raise AssertionError("unreachable")

    async def _one(self, c: Call) -> Any:
        if c.script is None:
            return await self.redis.execute_command(*c.args)
        return await self.redis.evalsha(self.sha[c.script], len(c.keys), *c.keys, *c.args)

    async def _pipeline(self, calls: tuple[Call, ...]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for c in calls:
            if c.script is None:
                pipe.execute_command(*c.args)
            else:
                pipe.evalsha(self.sha[c.script], len(c.keys), *c.keys, *c.args)
        return list(await pipe.execute(raise_on_error=False))
