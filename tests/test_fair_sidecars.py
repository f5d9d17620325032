"""Tenant weights hold across sidecars: tenants of weights 5 : 3 : 1, each reaching its own
sidecar (as regional edges or sticky load balancers send them), backlogged on shared nodes, are
served in proportion to their weights — not by which sidecar asks first (shares.py)."""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import aiohttp

from devstack.procs import RedisServer, sidecars
from loadtest.bench_scale import Agents

WEIGHTS = {"t5": 5, "t3": 3, "t1": 1}
NODES, CAP, HOLD_S = 4, 4, 0.4  # 16 slots, ~40 admissions/s
OFFER = 40  # asks per second per tenant: every one of them stays backlogged
SECONDS, WARMUP_S = 24.0, 4.0  # shares counted after the warm-up, while all are backlogged
# Served shares within this many points of the weights (the target). Over a 10 s window
# (~330 admissions) quiet runs gave 53.6–55.5 / 33.3–35.0 / 11.2–11.5 against 55.6 / 33.3 /
# 11.1, and once, under the whole suite's load, 52.3 / 35.8 / 11.9 (3.3 off); the 20 s window
# halves what chance adds; without shares.py it is 18 off.
POINTS = 3.0

POLICY = """
redis: {{url: "{url}"}}
queue: {{max_depth: 100000, max_depth_per_tenant: 100000}}
classes: {{realtime: {{weight: 1, priority: 0, deadline_s: 60}}}}
tenants:
{tenants}
nodes:
{nodes}
"""


async def tenant_load(
    sock: str, tenant: str, stop_at: float, served: list[tuple[float, str]]
) -> None:
    conn = aiohttp.UnixConnector(path=sock, limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def one() -> None:
            body = {"tenant": tenant, "model": "m", "prompt_tokens": 100, "max_tokens": 100}
            async with s.post("http://sidecar/admit", json=body) as r:
                data = await r.json()
            if r.status != 200:
                return
            served.append((time.monotonic(), tenant))
            await asyncio.sleep(HOLD_S)
            rel = {"ticket": data["ticket"], "status": 200, "usage": {"prompt_tokens": 100}}
            async with s.post("http://sidecar/release", json=rel) as r2:
                await r2.read()

        tasks = []
        start = time.monotonic()
        i = 0
        while (due := start + i / OFFER) < stop_at:
            if (delay := due - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
            i += 1
        # Whatever still waits is cancelled at the end: the sidecars give it back.
        await asyncio.sleep(0.5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_weights_hold_across_sidecars(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    tenants = "\n".join(
        f'  {t}: {{keys: ["plain:k-{t}"], weight: {w}, limits: {{requests_per_s: 100000,'
        " request_burst: 100000, tokens_per_min: 1000000000, token_burst: 100000000}}"
        for t, w in WEIGHTS.items()
    )
    nodes = "\n".join(
        f'  n{i}: {{url: "http://127.0.0.1:{21000 + i}", models: [m], memory_source: kv,'
        f" max_inflight: {CAP}}}"
        for i in range(NODES)
    )
    policy = tmp_path / "policies.yaml"
    policy.write_text(POLICY.format(url=redis_server.url, tenants=tenants, nodes=nodes))
    agents = Agents(redis_server.url, NODES)
    agents.start()
    socks = {t: str(tmp_path / f"{t}.sock") for t in WEIGHTS}
    try:
        with sidecars(policy, list(socks.values()), tmp_path / "logs"):
            time.sleep(1.0)
            served: list[tuple[float, str]] = []

            async def run() -> float:
                start = time.monotonic()
                stop_at = start + SECONDS
                await asyncio.gather(
                    *(tenant_load(sock, t, stop_at, served) for t, sock in socks.items())
                )
                return start

            start = asyncio.run(run())
        window = [t for at, t in served if start + WARMUP_S <= at <= start + SECONDS]
        counts = collections.Counter(window)
        total = sum(counts.values())
        shares = {t: 100 * counts[t] / total for t in WEIGHTS}
        want = {t: 100 * w / sum(WEIGHTS.values()) for t, w in WEIGHTS.items()}
        print(f"served in the window: {dict(counts)}; shares {shares}; weights {want}")
        assert total >= 0.7 * (SECONDS - WARMUP_S) * NODES * CAP / HOLD_S  # the nodes stayed busy
        for t in WEIGHTS:
            assert abs(shares[t] - want[t]) <= POINTS, (shares, want)
    finally:
        agents.stop.set()
        agents.join(5)


class _Pipe:
    """Records the refresh's commands (shares.queue) the way a Redis pipeline takes them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *_a: self.calls.append(name)


def test_a_tenant_that_also_asks_here_is_not_held_for() -> None:
    """Hold back only for tenants whose traffic does not reach this sidecar: one that asks here
    too is ordered by this sidecar's queue already (support mix, two sidecars, every tenant on
    both: holding for tenants momentarily waiting only on the other cost realtime 20 points)."""
    from types import SimpleNamespace

    from admission.scheduling.shares import BLOCKED_S, LOCAL_S, Shares

    now = [1_000.0]
    policy = SimpleNamespace(tenants={}, weight_of=lambda _t: 1.0)
    sh = Shares(lambda: policy, wall=lambda: now[0])  # type: ignore[arg-type,return-value]

    def redis_says(waiting_elsewhere: str) -> None:
        pipe = _Pipe()
        sh.waiting, sh.clock = (lambda: {("m", "rt"): {"a": now[0]}}), (lambda: now[0])
        sh.queue(pipe)
        at_ms = int(now[0] * 1000)
        reply = {b"s:a": b"50000", b"s:b": b"0", b"s:c": b"0"}
        reply[f"w:{waiting_elsewhere}".encode()] = f"{at_ms}:{int(BLOCKED_S * 2000)}".encode()
        replies: list[Any] = [None] * len(pipe.calls)
        replies[pipe.calls.index("hgetall")] = reply
        sh.take(replies)

    redis_says("b")  # b waits only on another sidecar, far behind a: a is held back
    assert not sh.may_take("m", "rt", "a", 1000, 0.0, {"a"}, room=1)
    sh.served("m", "rt", "b", 1000)  # b asks here too: this queue orders it
    redis_says("b")
    assert sh.may_take("m", "rt", "a", 1000, 0.0, {"a"}, room=1)
    now[0] += LOCAL_S + 0.1  # b not seen here for LOCAL_S: its traffic went elsewhere
    redis_says("b")
    assert not sh.may_take("m", "rt", "a", 1000, 0.0, {"a"}, room=1)
    redis_says("c")  # c never asked here
    assert not sh.may_take("m", "rt", "a", 1000, 0.0, {"a"}, room=1)
