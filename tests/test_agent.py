"""Node agent + watermarks end to end: emulated node (simulated GPU), Redis, dispatcher."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.metrics import Metrics
from admission.nodes.agent import CLAMP_S, Agent
from admission.nodes.state import NodeState, Status
from admission.policy import Policy, load_policy, parse_policy
from admission.reload import PolicyHolder
from admission.scheduling.priority import BANDS
from admission.server import build_app
from admission.store import keys
from devstack.procs import RedisServer, free_port, stop_process, wait_for
from tests.conftest import ROOT

MiB = 1 << 20

POLICY = """
redis: {{url: "{redis}"}}
watermarks: {{hold: 0.50, drain: 0.60, reopen: 0.45, stale_after_s: 5}}
classes:
  realtime: {{weight: 8, priority: 0, deadline_s: 20}}
  batch: {{weight: 1, priority: 1, deadline_s: 20}}
tenants:
  t: {{keys: ["plain:k"], classes: [realtime, batch], limits: {{requests_per_s: 1000, tokens_per_min: 10000000, token_burst: 1000000}}}}
nodes:
  n1: {{url: "http://127.0.0.1:{port}", models: [tiny], memory_source: effective, max_inflight: {cap},
        device_url: "http://127.0.0.1:{port}/sim/device"}}
"""


@pytest.fixture(scope="module")
def node() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "--port", str(port), "--profile", "tiny"],
        cwd=ROOT,
        start_new_session=True,
    )
    wait_for(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health").status == 200,
        30,
        "emulator",
    )
    yield port
    stop_process(proc)


async def fault(port: int, **kw: Any) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{port}/sim/fault", json=kw) as r,
    ):
        assert r.status == 200


def make(redis_server: RedisServer, port: int, cap: int = 64) -> Policy:
    return parse_policy(POLICY.format(redis=redis_server.url, port=port, cap=cap))


async def test_effective_memory_drives_hold_drain_and_recovery(
    redis: Any, redis_server: RedisServer, node: int
) -> None:
    policy = make(redis_server, node)
    agent = Agent(redis, policy)
    async with aiohttp.ClientSession() as session:
        await fault(node, leak_bytes=0)
        st = (await agent.tick(session))[0]
        # tiny: 1 GiB card; weights 256 + activations 64 + pool 192 + context 16 MiB used; pool free.
        assert st.state == "open" and st.memory == pytest.approx((256 + 64 + 16) / 1024, abs=1e-3)
        assert st.gpu_used_bytes == (256 + 64 + 192 + 16) * MiB  # raw NVML-like reading
        # Thresholds are lowered in this policy: effective memory on a full card cannot exceed
        # 1 - free KV pool, so a leak alone reaches 0.85 only when the KV cache is busy too.
        await fault(node, leak_bytes=200 * MiB)  # something else eats the GPU
        st = (await agent.tick(session))[0]
        assert st.state == "hold" and 0.50 <= st.memory < 0.60
        await fault(node, leak_bytes=300 * MiB)
        st = (await agent.tick(session))[0]
        assert st.state == "drain"
        published = json.loads(await redis.get(keys.node_state("n1")))
        assert published["state"] == "drain" and 0 < await redis.pttl(keys.node_state("n1")) <= 5000
        assert published["decode_s"] == 0.0 and published["tpot_s"] == 0.0  # idle: nothing seen
        await fault(node, leak_bytes=150 * MiB)  # below hold, above reopen: still not open
        st = (await agent.tick(session))[0]
        assert st.state == "hold"
        await fault(node, leak_bytes=0)
        st = (await agent.tick(session))[0]
        assert st.state == "open"


async def test_dead_node_is_down(redis: Any, redis_server: RedisServer) -> None:
    policy = make(redis_server, free_port())  # nothing listens there
    async with aiohttp.ClientSession() as session:
        st = (await Agent(redis, policy).tick(session))[0]
    assert st.state == "down" and st.healthy is False


@pytest.fixture
async def sidecar(
    redis: Any, redis_server: RedisServer, node: int, tmp_path: Path
) -> AsyncIterator[tuple[TestClient[Any, Any], Agent]]:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY.format(redis=redis_server.url, port=node, cap=1))
    holder = PolicyHolder(path, load_policy(path), Metrics())
    client = TestClient(TestServer(build_app(holder)))
    await client.start_server()
    yield client, Agent(redis, holder.current)
    await client.close()


async def test_held_requests_wait_then_run_in_priority_order(sidecar: Any, node: int) -> None:
    client, agent = sidecar
    async with aiohttp.ClientSession() as session:
        await fault(node, leak_bytes=200 * MiB)
        assert (await agent.tick(session))[0].state == "hold"
        await asyncio.sleep(0.25)

        async def admit(cls: str) -> dict[str, Any]:
            r = await client.post(
                "/admit", json={"tenant": "t", "class": cls, "model": "tiny", "max_tokens": 10}
            )
            assert r.status == 200
            return dict(await r.json())

        batch = asyncio.ensure_future(admit("batch"))
        await asyncio.sleep(0.1)
        realtime = asyncio.ensure_future(admit("realtime"))
        await asyncio.sleep(0.5)
        assert not batch.done() and not realtime.done()  # held, not refused
        await fault(node, leak_bytes=0)
        await agent.tick(session)  # memory frees: open
        first = await asyncio.wait_for(realtime, 5)  # max_inflight 1: one at a time
        assert not batch.done()
        assert first["class"] == "realtime"
        await client.post(
            "/release", json={"ticket": first["ticket"], "status": 200, "usage": None}
        )
        second = await asyncio.wait_for(batch, 5)
        assert second["class"] == "batch" and second["priority"] // BANDS == 1
        await client.post(
            "/release", json={"ticket": second["ticket"], "status": 200, "usage": None}
        )


async def test_two_sidecar_processes_never_exceed_a_node_cap(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        POLICY.format(redis=redis_server.url, port=1, cap=5).replace(
            "deadline_s: 20", "deadline_s: 1.5"
        )
    )
    state = NodeState(node="n1", seq=1, state=Status.OPEN, source="kv", healthy=True, memory=0.1)
    await redis.set(keys.node_state("n1"), state.to_json(), px=60_000)
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "admission.cli",
                "serve",
                "--policy",
                str(path),
                "--port",
                str(p),
                "--edge-over-tcp",
            ],
            cwd=ROOT,
            start_new_session=True,
        )
        for p in ports
    ]
    try:
        for p in ports:
            wait_for(
                lambda p=p: urllib.request.urlopen(f"http://127.0.0.1:{p}/healthz").status == 200,
                30,
                "sidecar",
            )
        body = {"tenant": "t", "model": "tiny", "max_tokens": 10}
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> int:
                async with s.post(f"http://127.0.0.1:{ports[i % 2]}/admit", json=body) as r:
                    return r.status

            statuses = await asyncio.gather(*(one(i) for i in range(40)))
        assert statuses.count(200) == 5, statuses
        assert statuses.count(503) == 35  # queue_timeout after the class deadline
        assert await redis.zcard(keys.node_leases("n1")) == 5
    finally:
        for p in procs:
            stop_process(p)


async def test_hung_or_failing_engine_is_down_then_recovers(
    redis: Any, redis_server: RedisServer, node: int
) -> None:
    policy = make(redis_server, node)
    agent = Agent(redis, policy)
    async with aiohttp.ClientSession() as session:
        await fault(node, hang=True)  # /health never answers: the sample times out
        st = (await agent.tick(session))[0]
        assert st.state == "down" and st.healthy is False
        await fault(node, hang=False, error_rate=1.0)  # healthy, but every generation fails
        async with session.post(
            f"http://127.0.0.1:{node}/v1/completions", json={"prompt": "x", "max_tokens": 2}
        ) as r:
            assert r.status == 500
        await fault(node, error_rate=0.0)
        st = (await agent.tick(session))[0]
        assert st.state == "open"


async def test_the_engines_prefix_cache_hit_ratio_reaches_the_node_state(
    redis: Any, redis_server: RedisServer, node: int
) -> None:
    """The emulator caches prefixes as vLLM V1 does; the agent reads its counters: requests
    that repeat a long prompt show up as a high hit ratio (what makes booked KV exceed KV in
    use), published for the sidecars, /status.json and the node gauge."""
    agent = Agent(redis, make(redis_server, node))
    system = "You are a support assistant for ACME. " * 40  # ~1,500 characters, shared
    async with aiohttp.ClientSession() as session:
        await agent.tick(session)  # the counters' first reading

        async def ask(text: str) -> None:
            body = {"model": "tiny", "prompt": text, "max_tokens": 2}
            async with session.post(f"http://127.0.0.1:{node}/v1/completions", json=body) as r:
                assert r.status == 200

        for i in range(5):  # the first computes the shared part, the next four find it
            await ask(system + f"question {i}")
        st = (await agent.tick(session))[0]
        # 1,530 characters = 382 tokens; the shared 1,520 fill 23 whole 16-token blocks.
        assert st.prefix_hit_ratio == pytest.approx(4 * 23 * 16 / (5 * 382), abs=0.01)
        published = json.loads(await redis.get(keys.node_state("n1")))
        assert published["prefix_hit_ratio"] == pytest.approx(st.prefix_hit_ratio)


def test_prefill_rate_counts_the_tokens_computed_not_those_found_cached() -> None:
    """vllm:prompt_tokens_total counts whole prompts, prefix-cache hits included; the ledger's
    pending prefill counts only the uncached part, so the rate that drains it must too."""
    from admission.nodes.agent import EngineSample, computed

    assert computed(EngineSample(prompt_tokens=10_000.0, prefix_hits=6_000.0)) == 4_000.0
    assert computed(EngineSample(prompt_tokens=10_000.0)) == 10_000.0  # no prefix counters
    # vllm:prompt_tokens_cached counts with prompt_tokens (at a prefill's end), the prefix
    # cache's hits at its start: the former when the engine has it.
    both = EngineSample(prompt_tokens=10_000.0, prompt_cached=5_000.0, prefix_hits=6_000.0)
    assert computed(both) == 5_000.0
    assert computed(EngineSample()) is None


def test_booking_factor_follows_what_the_ledger_booked_per_token_computed() -> None:
    """The ledger books prompts less the prefix index's guess; the engine computes prompts less
    what it really found cached. The factor between them scales the rate that drains pending
    prefill: above 1 only while the engine has nothing waiting (a burst's bookings ahead of a
    backlog are not a miscount), 1 without enough evidence, bounded either way."""
    from admission.nodes.rates import Booking

    b = Booking()
    assert b.update(0.0, 0.0, 0.0, 0) == 1.0
    assert b.update(1.0, 500.0, 50.0, 0) == 1.0  # under MIN_TOKENS booked: no opinion yet
    f = b.update(2.0, 9_000.0, 900.0, 0)  # the engine found 9 in 10 booked tokens cached
    assert f == pytest.approx(10.0, rel=0.05)
    assert b.update(3.0, 18_000.0, 1_800.0, 3) == 1.0  # requests waiting: never faster
    b2 = Booking()  # the index expects hits the engine did not keep: drain slower
    b2.update(0.0, 0.0, 0.0, 0)
    assert b2.update(1.0, 3_000.0, 6_000.0, 0) == pytest.approx(0.5, rel=0.05)
    assert b2.update(2.0, 3_000.0, 6_000.0 + 1e9, 0) == pytest.approx(1 / Booking.MAX)
    assert b2.update(3.0, 0.0, 0.0, 0) == 1.0  # the engine restarted: no evidence again
    b3 = Booking()
    b3.update(0.0, 0.0, 0.0, 0)
    assert b3.update(1.0, 50_000.0, 0.0, 0) == Booking.MAX  # all found cached: bounded
    assert b3.update(2.0, None, 10.0, 0) == Booking.MAX  # ledger unread: the last factor


def test_decode_time_travels_from_the_agent_to_the_views() -> None:
    """`decode_s` (rates.Tpot) is news on the feed when it moves, and a sidecar's view
    takes it; a state from an agent that predates it reads None (the guard then judges by
    `tpot_s` alone, as before)."""
    from admission.nodes.feed import moved
    from admission.policy import Node
    from admission.scheduling.views import NodeView

    old = NodeState(node="n1", seq=1, state=Status.OPEN, source="kv", healthy=True, tpot_s=0.2)
    new = NodeState(**{**old.__dict__, "seq": 2, "decode_s": 0.03})
    assert moved(old, new) and not moved(new, NodeState(**{**new.__dict__, "seq": 3}))
    v = NodeView(Node(id="n1", url="http://127.0.0.1:1", models=("m",)))
    v.observe(NodeState.from_json(new.to_json()), maintenance=False)
    assert (v.tpot_s, v.decode_s) == (0.2, 0.03)
    legacy = json.loads(old.to_json())
    del legacy["decode_s"]
    v.observe(NodeState.from_json(json.dumps(legacy)), maintenance=False)
    assert v.decode_s is None and v.snapshot(0.0)["decode_ms"] is None


class _Probe:
    """A probe that reports a fixed engine state (the clamp's wiring, not the reading)."""

    def __init__(self, state: NodeState) -> None:
        self.state = state

    async def sample(self, _policy: Policy, _booked: float | None = None) -> NodeState:
        return self.state


@pytest.mark.parametrize("waiting", [0, 3])
async def test_a_node_with_nothing_waiting_has_its_pending_prefill_cut(
    redis: Any, redis_server: RedisServer, waiting: int
) -> None:
    """The ledger's pending prefill drains at the measured rate, which below saturation reads
    what the node was given: it drifts. With nothing waiting in the engine, at most
    `CLAMP_S` of the rate stays pending; with a queue there, the ledger is left alone."""
    policy = make(redis_server, free_port())
    agent = Agent(redis, policy)
    rate = 1000.0
    st = NodeState(
        node="n1",
        seq=1,
        state=Status.OPEN,
        source="effective",
        healthy=True,
        memory=0.1,
        prefill_rate=rate,
        running=4,
        waiting=waiting,
    )
    agent._probes["n1"] = _Probe(st)  # type: ignore[assignment]
    agent._probe = lambda n, s: agent._probes[n.id]  # type: ignore[method-assign]
    ledger = keys.node_ledger("n1")
    sec, usec = await redis.time()
    await redis.hset(ledger, mapping={"p": "50000", "t": str(sec * 1_000_000 + usec)})
    async with aiohttp.ClientSession() as session:
        await agent.tick(session)
    p = float(await redis.hget(ledger, "p"))
    kept = 50_000 if waiting else rate * CLAMP_S
    # Drained for the few ms the tick took, at the rate, and cut only with nothing waiting.
    assert kept - 0.2 * rate <= p <= kept, p
    await redis.delete(ledger)
