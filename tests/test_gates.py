"""One rule per node gate, on both sides: the sidecar's guess (`gates.why_not`) and the
ledger's decision (store/lua/lease.lua, on a real redis-server) agree, over hypothesis-drawn
node ledgers and asks. The gates both sides hold: in-flight leases, pending prefill against
the class's budget (none while the urgent class has KV booked), reserved KV against the
watermark in tokens (the urgent class counting only its own), the urgent reserve lower classes
leave free. (Measured memory and the decode guard are the sidecar's alone; prefix hits and the
reserve's decay depend on Redis's clock, and are left out here.)

Checked to fail when one side alone changes: each of lease.lua's four rules, and each of the
sidecar's, moved by one at its boundary (`>` made `>=`), makes hypothesis find a disagreement.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission.nodes.state import Status
from admission.policy import load_policy
from admission.scheduling import leases
from admission.scheduling.ask import Ask
from admission.scheduling.gates import why_not
from admission.scheduling.views import NodeView
from admission.store import Scripts, keys
from devstack.procs import RedisServer
from devstack.stack import DEFAULT_POLICY

POLICY = load_policy(DEFAULT_POLICY)
NODE = next(iter(POLICY.nodes.values()))
URGENT, LOWER = "realtime", "batch"  # realtime is admitted until drain in the shipped policy

ledgers = st.fixed_dictionaries(
    {
        "max_inflight": st.integers(1, 8),
        "leases": st.integers(0, 9),
        "pending": st.integers(0, 6000),
        "kv": st.integers(0, 30000),
        "urgent_share": st.floats(0, 1),
    }
)
# Limits drawn around where each rule flips (an offset from what the ask would bring the node
# to: -2..2 most often), or off (-1 / 0): a rule changed at its boundary alone is found.
near = st.one_of(st.integers(-2, 2), st.integers(-3, 3), st.integers(-20000, 20000))
asks = st.fixed_dictionaries(
    {
        "urgent": st.booleans(),
        "prompt": st.integers(0, 4000),
        "output": st.integers(1, 4000),
        "budget": st.one_of(st.none(), near),
        "kv_limit": st.one_of(st.none(), near),
        "reserve_limit": st.one_of(st.none(), near),
        "urgent_waiting": st.integers(0, 5000),
    }
)


def limits(ledger: dict[str, Any], a: dict[str, Any]) -> tuple[int, int, int]:
    """(prefill budget, KV limit, reserve limit) of the drawn ask, placed around its
    boundaries on this ledger."""
    u = int(ledger["kv"] * ledger["urgent_share"])
    kv = a["prompt"] + a["output"]
    uw = 0 if a["urgent"] else a["urgent_waiting"]
    budget = 0 if a["budget"] is None else max(1, ledger["pending"] + a["prompt"] + a["budget"])
    mine = u if a["urgent"] else ledger["kv"]
    kv_limit = -1 if a["kv_limit"] is None else max(0, mine + kv + a["kv_limit"])
    res = ledger["kv"] - u + kv + u + uw
    reserve = -1 if a["reserve_limit"] is None else max(0, res + a["reserve_limit"])
    return budget, kv_limit, reserve


async def lease_lua(client: Any, ledger: dict[str, Any], node: Any, ask: Ask) -> bool:
    await client.flushall()
    far = 10**18  # µs: no lease expires during the check
    members = {f"{'a' * 16}{i:04d}:{node.id}:t": far for i in range(ledger["leases"])}
    if members:
        await client.zadd(keys.node_leases(node.id), members)
    u = int(ledger["kv"] * ledger["urgent_share"])
    now = await client.time()
    await client.hset(
        keys.node_ledger(node.id),
        mapping={
            "p": ledger["pending"],
            "t": int(now[0]) * 1_000_000 + int(now[1]),
            "kv": ledger["kv"],
            "u": u,
            "s": 0,
        },
    )
    scripts = Scripts(client)
    res = (await scripts.run(leases.take(node, f"{'b' * 16}:{node.id}:t", 60, ask)))[0]
    return leases.granted(res)


def sidecar(ledger: dict[str, Any], node: Any, ask: Ask) -> bool:
    v = NodeView(node)
    v.state = Status.OPEN
    u = int(ledger["kv"] * ledger["urgent_share"])
    v.ledger(float(ledger["pending"]), ledger["kv"], ledger["leases"], 0.0, u, 0.0, 0)
    return why_not(v, ask, POLICY, URGENT if ask.urgent else LOWER, 0.0) is None


def test_sidecar_and_ledger_agree_on_every_gate(redis_server: RedisServer) -> None:
    loop = asyncio.new_event_loop()
    client = aioredis.Redis.from_url(redis_server.url)

    @settings(
        max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(ledger=ledgers, a=asks)
    def check(ledger: dict[str, Any], a: dict[str, Any]) -> None:
        node = dataclasses.replace(NODE, max_inflight=ledger["max_inflight"])
        urgent = a["urgent"]
        budget, kv_limit, reserve_limit = limits(ledger, a)
        ask = Ask(
            a["prompt"],
            a["prompt"] + a["output"],
            0.0,  # prefill rate 0: pending is not drained by the clock on either side
            0 if urgent else budget,
            kv_limit,
            urgent=urgent,
            reserve_limit=-1 if urgent else reserve_limit,
            urgent_waiting=0 if urgent else a["urgent_waiting"],
        )
        by_ledger = loop.run_until_complete(lease_lua(client, ledger, node, ask))
        assert sidecar(ledger, node, ask) == by_ledger, (ledger, ask)

    try:
        check()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
