"""Tenant node pools: a tenant's own nodes serve it first, idle pool capacity is lent, owners
take it back by admission order; the policy says whether pools lend and owners spill."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from admission.errors import PolicyError, QueueTimeout
from admission.limits import Limiter
from admission.metrics import Metrics
from admission.nodes.state import NodeState, Status
from admission.policy import Policy, parse_policy
from admission.scheduling import Dispatcher
from admission.scheduling.routing import pool_rank
from admission.store import Store, connect, keys
from devstack.procs import RedisServer

POLICY = """
version: 1
redis: {url: "REDIS_URL", command_timeout_ms: 500, connect_timeout_ms: 500}
classes:
  realtime: {weight: 1, priority: 0, deadline_s: 3}
tiers: {platinum: 5, free: 1}
tenants:
  vip:
    tier: platinum
    keys: ["plain:sk-vip"]
    limits: {requests_per_s: 1000, request_burst: 1000, tokens_per_min: 6000000, token_burst: 100000}
  other:
    tier: free
    keys: ["plain:sk-other"]
    limits: {requests_per_s: 1000, request_burst: 1000, tokens_per_min: 6000000, token_burst: 100000}
pools:
  vip-gpus: {tiers: [platinum], lend: LEND, spill: SPILL}
nodes:
  mine: {url: "http://127.0.0.1:1", models: [m], memory_source: kv, max_inflight: 2, pool: vip-gpus,
         gpus: ["MIG-4f5c2e1a-0000-0000-0000-000000000001"]}
  shared: {url: "http://127.0.0.1:2", models: [m], memory_source: kv, max_inflight: 2}
"""


def pools_policy(
    url: str = "redis://127.0.0.1:1/0", lend: bool = True, spill: bool = True
) -> Policy:
    text = POLICY.replace("REDIS_URL", url).replace("LEND", str(lend).lower())
    return parse_policy(text.replace("SPILL", str(spill).lower()))


def test_pools_parse_from_tenants_or_tiers_and_nodes_may_be_mig_instances() -> None:
    p = pools_policy()
    assert p.tenant_pool == {"vip": "vip-gpus"}
    assert p.pools["vip-gpus"].tenants == ("vip",) and p.pools["vip-gpus"].lend
    assert p.nodes["mine"].pool == "vip-gpus" and p.nodes["shared"].pool is None
    assert p.nodes["mine"].gpus == ("MIG-4f5c2e1a-0000-0000-0000-000000000001",)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            ("tiers: [platinum]", "tenants: [nobody]"),
            ("pools.vip-gpus.tenants", "no tenant 'nobody'"),
        ),
        (("pool: vip-gpus,", "pool: elsewhere,"), ("nodes.mine.pool", "no pool 'elsewhere'")),
        (
            ("pools:\n", "pools:\n  second: {tenants: [vip]}\n"),
            ("pools.vip-gpus", "already in pool"),
        ),
        (("lend: LEND", "lend: maybe"), ("pools.vip-gpus.lend", "must be true or false")),
        (('gpus: ["MIG-', 'gpus: ["gpu0-'), ("nodes.mine.gpus", "must be a list")),
    ],
)
def test_pool_problems_are_reported(change: tuple[str, str], problem: tuple[str, str]) -> None:
    text = POLICY.replace(*change).replace("REDIS_URL", "redis://h:1/0")
    with pytest.raises(PolicyError) as ei:
        parse_policy(text.replace("LEND", "true").replace("SPILL", "true"))
    assert any(line.startswith(problem[0]) and problem[1] in line for line in ei.value.problems), (
        ei.value.problems
    )


def test_pool_rank_orders_own_shared_lent() -> None:
    p = pools_policy()
    mine, shared = p.nodes["mine"], p.nodes["shared"]
    assert pool_rank(p, "vip", mine) == 0 and pool_rank(p, "vip", shared) == 1
    assert pool_rank(p, "other", shared) == 1 and pool_rank(p, "other", mine) == 2
    assert pool_rank(p, "other", mine, frozenset({"vip-gpus"})) is None  # owners waiting
    assert pool_rank(pools_policy(lend=False), "other", mine) is None
    assert pool_rank(pools_policy(spill=False), "vip", shared) is None


def make(p: Policy) -> tuple[Dispatcher, Any]:
    client = connect(p.redis)
    st = Store.over(client, Metrics())
    d = Dispatcher(st, Limiter(st, lambda: p, st.backlog.metrics), lambda: p, Metrics())
    for v in d.nodes.views.values():
        v.state = Status.OPEN
    return d, client


async def test_owner_first_on_its_pool_idle_pool_lent_then_taken_back(
    redis: Any, redis_server: RedisServer
) -> None:
    p = pools_policy(redis_server.url)
    d, client = make(p)
    for n in ("mine", "shared"):  # as the agents publish them (the loop refreshes from Redis)
        st = NodeState(node=n, seq=1, state=Status.OPEN, source="kv", healthy=True, memory=0.1)
        await redis.set(keys.node_state(n), st.to_json(), px=60_000)
    vip, other = p.tenants["vip"], p.tenants["other"]
    task = asyncio.create_task(d.run())
    try:
        # The owner goes to its own node even though the shared one is as free.
        a = await d.admit(vip, "realtime", "m", 10, 10)
        assert a.node == "mine"
        assert (await d.admit(other, "realtime", "m", 10, 10)).node == "shared"
        # Shared full (2), the pool has a free slot and no owner waits: lent.
        b = await d.admit(other, "realtime", "m", 10, 10)
        assert b.node == "shared"
        lent = await d.admit(other, "realtime", "m", 10, 10)
        assert lent.node == "mine"  # `mine` is now full too (vip + lent)
        # Both nodes full: an owner and a borrower queue, the borrower first. The pool's next
        # free slot goes to the owner (admission order), not to the borrower ahead of it.
        borrower = asyncio.ensure_future(d.admit(other, "realtime", "m", 10, 10))
        await asyncio.sleep(0.05)
        owner = asyncio.ensure_future(d.admit(vip, "realtime", "m", 10, 10))
        await asyncio.sleep(0.05)
        assert len(d.queue) == 2
        await d.release(lent.ticket, 20)  # the loan ends: `mine` has room
        got = await asyncio.wait_for(owner, 2)
        assert got.node == "mine"
        assert not borrower.done()  # still waiting: the pool was taken back, not lent again
        await d.release(b.ticket, 20)  # a shared slot frees: the borrower goes there
        assert (await asyncio.wait_for(borrower, 2)).node == "shared"
        assert await redis.zcard(keys.node_leases("mine")) == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_no_lending_and_no_spill(redis: Any, redis_server: RedisServer) -> None:
    p = pools_policy(redis_server.url, lend=False, spill=False)
    d, client = make(p)
    vip, other = p.tenants["vip"], p.tenants["other"]
    for _ in range(2):
        adm = await d.admit(other, "realtime", "m", 10, 10)
        assert adm.node == "shared" and adm.fallbacks == []  # not even to fall back on
    for _ in range(2):
        assert (await d.admit(vip, "realtime", "m", 10, 10)).node == "mine"
    # Everything full: neither gets the other's nodes; both time out in the queue (3 s).
    outcomes = await asyncio.gather(
        *(d.admit(t, "realtime", "m", 10, 10) for t in (other, vip)), return_exceptions=True
    )
    assert all(isinstance(o, QueueTimeout) for o in outcomes), outcomes
    await client.aclose()


@pytest.mark.parametrize(
    "classes",
    [
        "realtime: {weight: 1, priority: 0, deadline_s: 3}",
        # Negative priorities: lent work must still go behind the owners' least urgent class.
        "realtime: {weight: 1, priority: -5, deadline_s: 3}\n  batch: {weight: 1, priority: 0, "
        "deadline_s: 9}",
    ],
)
def test_lent_work_runs_behind_the_owners_inside_the_engine(classes: str) -> None:
    """On a pool's node, a borrower's request carries a vLLM priority below every class of the
    owners: vLLM schedules the owners' requests first and preempts borrowed work for them."""
    from admission.scheduling.priority import engine_priority

    p = parse_policy(
        POLICY.replace("realtime: {weight: 1, priority: 0, deadline_s: 3}", classes)
        .replace("REDIS_URL", "redis://127.0.0.1:1/0")
        .replace("LEND", "true")
        .replace("SPILL", "true")
    )
    mine, shared = p.nodes["mine"], p.nodes["shared"]
    owners = [engine_priority(p, c, c, "vip", mine, 9000, 9000) for c in p.classes]  # cold
    first = engine_priority(p, "realtime", "realtime", "vip", mine)
    assert engine_priority(p, "realtime", "realtime", "other", shared) == first
    for c in p.classes:  # a prompt the node holds, of any class
        assert engine_priority(p, c, c, "other", mine, 9000, 0) > max(owners)  # lent: behind


def test_borrowers_are_held_at_hold_on_a_lent_node_owners_may_go_to_drain() -> None:
    """An urgent class (admit_until: drain) may use the hold→drain band of a node, except on a
    pool's node it borrows: that band, and the prefill room, stay the owners'."""
    from admission.scheduling.ask import Request
    from admission.scheduling.routing import ClusterFacts, eligible
    from admission.scheduling.views import NodeView

    text = POLICY.replace("deadline_s: 3}", "deadline_s: 3, admit_until: drain}")
    p = parse_policy(
        text.replace("REDIS_URL", "redis://h:1/0").replace("LEND", "true").replace("SPILL", "true")
    )
    views = [NodeView(n) for n in p.nodes.values()]
    for v in views:
        v.state, v.memory = Status.HOLD, 0.82
    owner = eligible(views, p, Request("m", "realtime", 10, 10, tenant="vip"), ClusterFacts(0.0))
    borrower = eligible(
        views, p, Request("m", "realtime", 10, 10, tenant="other"), ClusterFacts(0.0)
    )
    assert [v.node.id for v, _ask in owner] == ["mine", "shared"]  # own pool first
    assert [v.node.id for v, _ask in borrower] == ["shared"]


def test_check_diff_names_pool_changes() -> None:
    from admission.policy.diff import describe

    lending, closed = pools_policy(lend=True), pools_policy(lend=False)
    assert "pool vip-gpus: lend: True → False" in describe(lending, closed)
    base = parse_policy(
        POLICY.replace("pools:\n  vip-gpus: {tiers: [platinum], lend: LEND, spill: SPILL}\n", "")
        .replace(" pool: vip-gpus,", "")
        .replace("REDIS_URL", "redis://h:1/0")
    )
    assert describe(base, lending) == [
        "node mine: pool: None → 'vip-gpus'",
        "pool vip-gpus added: owned by vip, lends idle capacity",
    ]


def test_nvml_reader_addresses_devices_by_index_or_uuid() -> None:
    """A MIG instance is named by UUID in the policy; the reader asks NVML by UUID for those
    and by index for the others (pynvml's calls, faked: this machine has no GPU;
    scripts/gpu_check.py runs the same on a real card)."""
    from types import SimpleNamespace

    from admission.nodes.gpu import NvmlReader

    calls: list[tuple[str, Any]] = []
    mem = {"h0": (10, 80), "hmig": (3, 10)}
    fake = SimpleNamespace(
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("index", i)) or "h0",
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(("uuid", u)) or "hmig",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=mem[h][0], total=mem[h][1]),
    )
    r = NvmlReader()
    r._nvml, r.available = fake, True
    got = r.read_sync((0, "MIG-4f5c2e1a-0000-0000-0000-000000000001"))
    assert got is not None and (got.used_bytes, got.total_bytes) == (13, 90)
    assert calls == [("index", 0), ("uuid", "MIG-4f5c2e1a-0000-0000-0000-000000000001")]
    r.available = False  # nothing to shut down: it never initialised NVML here
