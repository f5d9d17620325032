"""The Redis connection and the one place that says which Redis failures mean "unavailable".

Every other module catches `REDIS_DOWN` and nothing else from redis-py: a connection that broke,
timed out or is still loading, and the reply errors a healthy Redis gives while it cannot take
writes (READONLY after a failover, OOM at maxmemory, CLUSTERDOWN, TRYAGAIN, MASTERDOWN,
LOADING). Those reach us as `ResponseError`s; `raise_if_down` turns them into `StoreDown` so
they take the same fail-open/fail-closed path as a dead connection instead of killing a task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import hiredis
import redis.asyncio as aioredis
from redis import exceptions as rex

from admission.policy import RedisSettings


class StoreDown(rex.ConnectionError):
    """Redis answered, but with an error that says it cannot serve us now (READONLY, OOM…)."""


REDIS_DOWN: tuple[type[BaseException], ...] = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.BusyLoadingError,
    OSError,
    # Redis Cluster: no node serves the slot, or redirections (MOVED/ASK storms during a
    # reshard or failover) ran out of retries.
    rex.ClusterError,
    rex.SlotNotCoveredError,
)

# Reply-error prefixes that a retry later can cure; any other ResponseError is our bug.
_UNAVAILABLE = ("READONLY", "OOM", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "LOADING", "BUSY ")


# redis-py parses the commonest of those into classes and strips the prefix from the message
# ("READONLY You can't write…" arrives as ReadOnlyError("You can't write…")): both are checked.
_UNAVAILABLE_CLASSES = (
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.ClusterDownError,  # MASTERDOWN too
)


CLUSTER_BUSY_PAUSE_S = 0.01  # a Cluster client's pool full: pause before trying again
CLUSTER_RETRIES = 3  # a call written to a closed connection, made again
T = TypeVar("T")


def is_down(result: Any) -> bool:
    """True for a result or exception that means Redis cannot serve us now."""
    if isinstance(result, REDIS_DOWN + _UNAVAILABLE_CLASSES):
        return True
    return isinstance(result, rex.ResponseError) and str(result).startswith(_UNAVAILABLE)


def dropped(exc: BaseException) -> bool:
    """Whether `exc` is one pooled connection closed under a round trip ("Connection closed by
    server"), not Redis away: the hot path asks again at once, once, on another connection
    (its scripts are idempotent). Seen among 8 sidecars on a loaded Redis Cluster."""
    return type(exc) is rex.ConnectionError


def raise_if_down(results: list[Any]) -> None:
    """Raise the first result of a batch that means "Redis unavailable" (as StoreDown)."""
    for r in results:
        if isinstance(r, REDIS_DOWN):
            raise r
        if is_down(r):
            raise StoreDown(str(r)) from r


async def on_cluster(
    client: Any, call: Callable[[], Awaitable[T]], retries: int = CLUSTER_RETRIES
) -> T:
    """Run a Redis Cluster client's call. Its pool per master does not wait for a connection:
    every one in use is this process's overload (PoolBusy, after a short pause so that a wait
    in line does not spin), not an outage. And it keeps connections whose socket closed under
    it (a timeout): writing to one fails before anything is sent ("unable to perform
    operation on <TCPTransport closed=True>", "'NoneType' object has no attribute
    'writelines'"); those are closed for good and the call made again (`retries` times: only
    a call that sends once — not a pipeline). A call that still finds its connection closed
    after that is this process's trouble too (its own timeouts close them faster than it gets
    them back, under CPU starvation), not an outage: nothing was sent, and a Redis that is
    really gone refuses the new connection each retry opens (a ConnectionError, raised as
    such). So: PoolBusy — the caller waits in line, never the failure mode for it. Without
    retries (a pipeline, which may have sent part), the connection counts as lost."""
    for attempt in range(retries + 1):
        try:
            return await call()
        except rex.MaxConnectionsError as exc:
            await asyncio.sleep(CLUSTER_BUSY_PAUSE_S)
            raise PoolBusy(str(exc)) from exc
        except (RuntimeError, AttributeError) as exc:
            await _drop_closed(client)
            await asyncio.sleep(CLUSTER_BUSY_PAUSE_S * attempt)  # the closing may be in flight
            if attempt == retries:
                if retries:
                    raise PoolBusy(f"connections keep closing under this process: {exc}") from exc
                raise rex.ConnectionError(f"connection lost: {exc}") from exc
    raise AssertionError("unreachable")


async def _drop_closed(client: Any) -> None:
    """Disconnect the Cluster client's connections whose socket is gone (redis-py reuses them
    as if connected; disconnected, it connects them again on their next use)."""
    for node in client.get_nodes():
        for conn in list(getattr(node, "_connections", ())):
            writer = getattr(conn, "_writer", None)
            if writer is not None and writer.transport.is_closing():
                await conn.disconnect()


class PoolBusy(rex.ConnectionError):
    """Every connection of this process's pool stayed in use for `pool_wait_ms`: this process
    is overloaded, while Redis may be fine. Still a ConnectionError (anything that does not ask
    is safe treating it as "down"), but the limiter answers it 503 `admission_busy` instead of
    switching the process to its failure mode."""


class _Pool(aioredis.BlockingConnectionPool):
    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except rex.ConnectionError as exc:
            # redis-py's own words for "waited `timeout` for a free connection".
            if str(exc).startswith("No connection available"):
                raise PoolBusy(str(exc)) from exc
            raise


def _pack(args: tuple[Any, ...]) -> bytes:
    # As redis-py's sync HiredisRespSerializer: "SCRIPT LOAD" is two words on the wire.
    if isinstance(args[0], str):
        args = (*args[0].encode().split(), *args[1:])
    elif b" " in args[0]:
        args = (*args[0].split(), *args[1:])
    args = tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a for a in args)
    try:
        return hiredis.pack_command(args)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise rex.DataError(str(exc)) from exc


class _HiredisPacking:
    """Commands packed by hiredis in C. redis-py packs in Python on its asyncio connections
    (~9 µs of sidecar CPU per script call, four calls per request; hiredis: ~1.6 µs) and uses
    hiredis only on its sync ones. Same bytes on the wire (tests/test_limiter.py checks). Not
    on Redis Cluster clients, which build their connections themselves."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [_pack(args)]

    def pack_commands(self, commands: Any) -> list[bytes]:
        return [b"".join([_pack(tuple(c)) for c in commands])]


def _hiredis_packing(cls: type) -> type:
    return type(f"Hiredis{cls.__name__}", (_HiredisPacking, cls), {})


class _Cluster(aioredis.RedisCluster):
    """A Redis Cluster client that does not send a call again by itself after a *timeout*
    (redis-py did, up to 10 times). A call that timed out is still queued in a slow Redis: it
    runs anyway, maybe after the give-back meant to undo it, or it booked a lease while the
    re-send found this process's pool full (PoolBusy: read as "nothing was sent") and the lease
    stayed until its TTL. What a timed-out call needs is decided by its caller (asked again
    when our own loop was late, else the failure mode). A lost connection is still sent again
    (a connection closed under a call, mostly one redis-py itself closes after a timeout: with
    those left to us, 8 sidecars on a loaded machine went into the failure mode and over
    their nodes' caps), and so is a call Redis refused to run (CLUSTERDOWN, no node for its
    slot), after the layout is read again."""

    ERRORS_ALLOW_RETRY = (  # type: ignore[assignment]
        rex.ConnectionError,
        rex.ClusterDownError,
        rex.SlotNotCoveredError,
    )


def connect(settings: RedisSettings, *, read_timeouts: bool = True) -> Any:
    """A redis-py asyncio client with short timeouts and a *blocking* pool.

    The default pool raises once all connections are busy; a blocking pool makes the excess
    wait `pool_wait_ms` instead, which under bursts is the difference between a queue and 503s.
    `read_timeouts=False`: no timer per command read (redis-py arms one per reply); the caller
    bounds each round trip as a whole (Scripts does, once per coalesced pipeline).
    """
    timeout = settings.command_timeout_ms / 1000
    if settings.cluster:
        return _Cluster.from_url(
            settings.url,
            socket_timeout=timeout,
            socket_connect_timeout=settings.connect_timeout_ms / 1000,
            max_connections=settings.pool_size,
        )
    pool = _Pool.from_url(
        settings.url,
        max_connections=settings.pool_size,
        timeout=settings.pool_wait_ms / 1000,
        socket_timeout=timeout if read_timeouts else None,
        socket_connect_timeout=settings.connect_timeout_ms / 1000,
    )
    pool.connection_class = _hiredis_packing(pool.connection_class)  # tcp, unix or tls
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) its pool


def connect_batch(settings: RedisSettings, url: str | None = None) -> Any:
    """A client for batch storage (files are megabytes, workers block on the stream): its own
    pool and long timeouts (the admission path keeps its short ones), on `url` (the policy's
    `batch.redis_url`) or the admission Redis; a Redis Cluster client when `redis.cluster`, one
    that does not send a timed-out call again by itself either (a second XADD of a batch line
    would run it twice)."""
    url = url or settings.url
    if settings.cluster:
        return _Cluster.from_url(url, socket_timeout=60, socket_connect_timeout=5)
    return aioredis.Redis.from_url(
        url, socket_timeout=60, socket_connect_timeout=5, max_connections=64
    )
