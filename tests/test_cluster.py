"""The limiter, leases and batch storage on a real 3-master Redis Cluster on loopback (hash
tags at work)."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions as rex

from admission.errors import Throttled
from admission.limits import Limiter
from admission.metrics import Metrics
from admission.scheduling import leases, round_trip
from admission.scheduling.ask import Ask
from admission.store import Store, connect
from devstack.procs import RedisServer, free_port
from tests.test_limiter import take, tenant_policy

pytestmark = pytest.mark.cluster


def cluster_policy(p: Any) -> Any:
    """`p` (a policy from tenant_policy) with its Redis read as a Redis Cluster."""
    return dataclasses.replace(p, redis=dataclasses.replace(p.redis, cluster=True))


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli missing: run scripts/setup.sh")
    base: Path = tmp_path_factory.mktemp("cluster")
    servers = []
    for i in range(3):
        port = free_port()
        while port > 55_000 or not _free(port + 10_000):  # the cluster bus listens on port + 10000
            port = free_port()
        s = RedisServer(
            base / str(i),
            [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "2000",
                "--logfile",
                str(base / f"redis-{i}.log"),
            ],
        )
        s.port = port
        s.start()
        servers.append(s)
    try:
        addrs = [f"127.0.0.1:{s.port}" for s in servers]
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *addrs,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for _ in range(100):
            info = subprocess.run(
                ["redis-cli", "-p", str(servers[0].port), "cluster", "info"],
                capture_output=True,
                text=True,
            ).stdout
            if "cluster_state:ok" in info:
                break
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{servers[0].port}/0"
    finally:
        for s in servers:
            s.stop()


async def test_limiter_on_cluster(cluster: str) -> None:
    p = tenant_policy(
        cluster, "{requests_per_s: 0.001, request_burst: 5, tokens_per_min: 60, token_burst: 1000}"
    )
    p = cluster_policy(p)
    client = connect(p.redis)
    try:
        lim = Limiter(Store.over(client, Metrics()), lambda: p, Metrics())
        t = p.tenants["t1"]
        for i in range(5):
            assert (await take(lim, t, f"r{i}", 100, 60))[0] == "redis"
        with pytest.raises(Throttled) as ei:
            await take(lim, t, "r5", 100, 60)
        assert ei.value.reason == "requests_per_s"
        assert await lim.settle(t, "r0", 40) == 60
        assert await lim.settle(t, "r0", 40) == 0
    finally:
        await client.aclose()


async def test_acquire_with_lease_and_settle_with_release_on_cluster(cluster: str) -> None:
    from admission.store import keys

    p = tenant_policy(cluster, "{requests_per_s: 100, tokens_per_min: 6000, token_burst: 1000}")
    p = cluster_policy(p)
    client = connect(p.redis)
    try:
        await client.flushall()  # the module's cluster is shared with the test above
        st = Store.over(client, Metrics())
        lim = Limiter(st, lambda: p, Metrics())
        node1 = dataclasses.replace(p.nodes["n1"], max_inflight=1)
        T1 = f"{'1' * 16}:n1:t1"
        lease = leases.take(node1, T1, 60, Ask(10, 100))
        t1 = p.tenants["t1"]
        acq, res = await round_trip.debit(lim, t1, "a", 100, 60, lease=lease, ticket=T1)
        assert acq.mode == "redis" and int(res[0]) == 1
        # The node views' failure mode asks when Redis last answered (nodetable.py).
        assert time.monotonic() - st.scripts.answered_at < 5
        lease2 = leases.take(node1, f"{'2' * 16}:n1:t1", 60, Ask(10, 100))
        _acq, res2 = await round_trip.debit(lim, t1, "b", 100, 60, lease=lease2)
        assert int(res2[0]) == 0  # cap 1 across the cluster
        release = leases.give_back(T1)
        assert await round_trip.settle(lim, [(t1, "a", 10, False)], [release]) == [90]
        assert await client.zcard(keys.node_leases("n1")) == 0
    finally:
        await client.aclose()


# Keeps a Redis busy for ARGV[1] ms (a script blocks the server: whatever arrives meanwhile waits).
BUSY_LUA = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + ARGV[1] * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


async def test_a_caller_gone_mid_round_trip_on_cluster_leaves_nothing_booked(cluster: str) -> None:
    """The client left (its handler cancelled: the sidecar runs with handler_cancellation) while
    the round trip carrying its debit and lease was out: on Redis Cluster too, what it took is
    given back once the round trip has run (tests/test_dispatcher.py has the single-Redis case).
    Before, the Cluster path sent no compensation: the lease and the reservation stayed."""
    import redis.asyncio as aioredis

    from admission.store import keys

    p = tenant_policy(cluster, "{requests_per_s: 100, tokens_per_min: 6000, token_burst: 1000}")
    p = cluster_policy(p)
    client = connect(p.redis)
    masters: list[Any] = []
    try:
        await client.flushall()
        lim = Limiter(Store.over(client, Metrics()), lambda: p, Metrics())
        t1, node = p.tenants["t1"], p.nodes["n1"]

        def debit(rid: str) -> Any:
            ticket = f"{rid}:n1:t1"
            lease = leases.take(node, ticket, 60, Ask(10, 100))
            return round_trip.debit(lim, t1, rid, 100, 60, lease=lease, ticket=ticket)

        warm = "w" * 16  # pooled connections to every master: the next calls go out at once
        assert leases.granted((await debit(warm))[1])
        assert await round_trip.settle(
            lim, [(t1, warm, 100, False)], [leases.give_back(f"{warm}:n1:t1")]
        )
        masters = [aioredis.Redis(host=n.host, port=n.port) for n in client.get_primaries()]
        busy = [asyncio.ensure_future(m.eval(BUSY_LUA, 0, 200)) for m in masters]
        await asyncio.sleep(0.02)
        rid = "c" * 16
        task = asyncio.ensure_future(debit(rid))
        await asyncio.sleep(0.05)  # sent; Redis busy
        time.sleep(0.3)  # the loop blocked: Redis runs the calls and answers meanwhile
        task.cancel()  # ... and the caller leaves before it reads the answers
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.gather(*busy)
        for _ in range(50):  # the compensation: 0.3 s on a quiet machine, more on a busy one
            await asyncio.sleep(0.1)
            if await client.zcard(keys.node_leases("n1")) == 0:
                break
        assert await client.zcard(keys.node_leases("n1")) == 0
        assert int(await client.hget(keys.node_ledger("n1"), "kv") or 0) == 0
        assert not await client.exists(keys.tenant_keys("t1", rid)[4])  # no reservation left
    finally:
        for m in masters:
            await m.aclose()
        await client.aclose()


async def test_batch_storage_on_cluster(cluster: str) -> None:
    """The Batch API's storage (every key of a tenant under one hash tag, scripts for what
    touches several) on the cluster: files in parts, lines by index, create, record, finalize."""
    from admission.store import connect_batch
    from tests.test_batch_store import check_store

    p = tenant_policy(cluster, "{requests_per_s: 100, tokens_per_min: 6000}")
    settings = dataclasses.replace(p.redis, cluster=True)
    client = connect_batch(settings)
    try:
        await client.flushall()
        await check_store(client)
    finally:
        await client.aclose()


async def test_a_connection_closed_under_the_client_is_overload_not_an_outage() -> None:
    # redis-py's Cluster client keeps connections whose socket its own timeouts closed: writing
    # to one fails before anything is sent. Made again after dropping them; one still closed
    # after every retry is this process's overload (wait in line), never the failure mode. A
    # Redis really gone refuses the new connection: that stays a ConnectionError (an outage).
    from admission.store.connection import CLUSTER_RETRIES, PoolBusy, on_cluster

    class Client:
        def get_nodes(self) -> list[Any]:
            return []

    tries = 0

    async def closed() -> None:
        nonlocal tries
        tries += 1
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    with pytest.raises(PoolBusy):
        await on_cluster(Client(), closed)
    assert tries == CLUSTER_RETRIES + 1

    async def refused() -> None:
        raise rex.ConnectionError("Error 111 connecting to 127.0.0.1:7000. Connection refused.")

    with pytest.raises(rex.ConnectionError) as ei:
        await on_cluster(Client(), refused)
    assert not isinstance(ei.value, PoolBusy)

    with pytest.raises(rex.ConnectionError) as ei:  # a pipeline (no retry) may have sent part
        await on_cluster(Client(), closed, 0)
    assert not isinstance(ei.value, PoolBusy)


async def test_a_timed_out_call_is_sent_once_not_again_by_the_cluster_client(cluster: str) -> None:
    """A call that timed out may still run (Redis was busy, not gone): the product decides
    what to do about it (give back what it booked, or ask again with the same ticket). redis-py's
    Cluster client re-sent it on its own (up to 3 more times, each on a new connection), so one
    lease could run after the give-back meant to undo it; and a re-send that found the pool full
    raised "pool busy", which the queue reads as "nothing was sent" — the lease it booked stayed
    until its TTL (tests/test_many_sidecars.py's leases left, ~1 run in 15). Sent once now."""
    import redis.asyncio as aioredis

    p = tenant_policy(cluster, "{requests_per_s: 100, tokens_per_min: 6000}")
    p = cluster_policy(p)
    client = connect(p.redis)  # command_timeout_ms: 200
    masters: list[Any] = []
    key = "{timed-out}:runs"
    try:
        await client.delete(key)
        node = client.get_node_from_key(key)
        masters = [aioredis.Redis(host=node.host, port=node.port)]
        busy = asyncio.ensure_future(masters[0].eval(BUSY_LUA, 0, 700))
        await asyncio.sleep(0.05)
        with pytest.raises(rex.TimeoutError):  # before: answered by a re-send (INCR → 2)
            await client.eval("return redis.call('INCR', KEYS[1])", 1, key)
        await busy
        await asyncio.sleep(0.3)  # whatever copies were sent have run
        assert int(await client.get(key) or 0) == 1
    finally:
        for m in masters:
            await m.aclose()
        await client.aclose()


async def test_the_batch_store_cluster_client_does_not_resend_a_timed_out_call(
    cluster: str,
) -> None:
    """The batch store's client (long timeouts, its own pool) keeps the same rule: a second
    XADD of a batch line after a timeout would run that line twice."""
    from admission.store import connect_batch

    p = tenant_policy(cluster, "{requests_per_s: 100, tokens_per_min: 6000}")
    p = cluster_policy(p)
    client = connect_batch(p.redis)
    try:
        await client.set("{batch}:probe", 1)
        assert int(await client.get("{batch}:probe")) == 1
        assert rex.TimeoutError not in type(client).ERRORS_ALLOW_RETRY
        assert rex.ConnectionError in type(client).ERRORS_ALLOW_RETRY
    finally:
        await client.aclose()


async def test_a_call_the_cluster_refused_to_run_is_sent_again(cluster: str) -> None:
    """CLUSTERDOWN (a failover, or a blip of the cluster's state on a loaded machine: seen in CI
    right after the first test of this module) means Redis did not run the call: the client
    reads the layout again and sends it again, as redis-py always did — only the calls that
    may have run are left to the caller."""
    from redis.asyncio.cluster import ClusterNode

    p = tenant_policy(cluster, "{requests_per_s: 100, tokens_per_min: 6000}")
    p = cluster_policy(p)
    client = connect(p.redis)
    key = "{refused}:runs"
    real = ClusterNode.execute_command
    refusals = [1]

    async def down_once(self: Any, *args: Any, **kw: Any) -> Any:
        if args and args[0] == "EVAL" and refusals[0]:
            refusals[0] -= 1
            raise rex.ClusterDownError("CLUSTERDOWN The cluster is down")
        return await real(self, *args, **kw)

    try:
        await client.delete(key)
        ClusterNode.execute_command = down_once  # type: ignore[method-assign]
        assert await client.eval("return redis.call('INCR', KEYS[1])", 1, key) == 1
        assert refusals == [0]
    finally:
        ClusterNode.execute_command = real  # type: ignore[method-assign]
        await client.aclose()


async def test_a_call_cancelled_under_the_round_trip_is_a_lost_connection_not_a_reply(
    cluster: str,
) -> None:
    """redis-py can cancel a call whose connection it closes while re-reading the layout; the
    gather of a Cluster round trip then held a CancelledError as that call's *reply*, and the
    limiter read it as one (TypeError: a 500 at the edge). It is a lost connection: asked
    again once, the request is admitted, and the failure mode stays off."""
    p = tenant_policy(cluster, "{requests_per_s: 100, tokens_per_min: 6000, token_burst: 1000}")
    p = cluster_policy(p)
    client = connect(p.redis)
    try:
        lim = Limiter(Store.over(client, Metrics()), lambda: p, Metrics())
        scripts = lim.store.scripts
        one, cancels = scripts._one, [1]

        async def cancelled_once(c: Any) -> Any:
            if cancels[0]:
                cancels[0] -= 1
                raise asyncio.CancelledError
            return await one(c)

        scripts._one = cancelled_once  # type: ignore[method-assign]
        assert (await take(lim, p.tenants["t1"], "x" * 16, 100, 60))[0] == "redis"
        assert cancels == [0] and not lim.degraded
    finally:
        await client.aclose()
