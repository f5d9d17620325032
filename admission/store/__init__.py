"""Redis plumbing, knowing nothing of tenants or queues: connection, failure classification,
scripts, keys and the backlog of calls owed to Redis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from admission.metrics import Metrics
from admission.policy import RedisSettings
from admission.store.backlog import Backlog
from admission.store.connection import (
    REDIS_DOWN,
    PoolBusy,
    StoreDown,
    connect,
    connect_batch,
    dropped,
    is_down,
)
from admission.store.scripts import Call, Orphan, Scripts


@dataclass
class Store:
    """One process's Redis: the client, its loaded scripts and its backlog, opened together."""

    redis: Any
    scripts: Scripts
    backlog: Backlog

    @classmethod
    def open(cls, settings: RedisSettings, metrics: Metrics) -> Store:
        redis = connect(settings)
        if settings.cluster:
            return cls.over(redis, metrics)
        # The hot path's scripts get their own client, bounded per round trip, not per reply.
        scripts = Scripts(
            connect(settings, read_timeouts=False),
            timeout_s=settings.command_timeout_ms / 1000,
            observe=metrics.redis_round_trip.observe,
        )
        return cls(redis, scripts, Backlog(scripts, metrics))

    @classmethod
    def over(cls, redis: Any, metrics: Metrics) -> Store:
        """A store over an existing client (tests, tools)."""
        scripts = Scripts(redis, observe=metrics.redis_round_trip.observe)
        return cls(redis, scripts, Backlog(scripts, metrics))

    async def close(self) -> None:
        if self.scripts.redis is not self.redis:
            await self.scripts.redis.aclose()
        await self.redis.aclose()


__all__ = [
    "REDIS_DOWN",
    "Backlog",
    "Call",
    "Orphan",
    "PoolBusy",
    "Scripts",
    "Store",
    "StoreDown",
    "connect",
    "connect_batch",
    "dropped",
    "is_down",
]
