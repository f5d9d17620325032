"""Many sidecars, two edges' worth, over a 3-master Redis Cluster and 512 nodes (states only).

Eight `admission serve` processes, each on its own unix socket; the load generator plays two
edges (each sends to its four sidecars, as an edge's `sidecar_sockets` list would: round
robin) and opens 1,000 asks a second, each admitted request held for `HOLD_S` and then
released as NGINX would. Agents publish the 512 nodes' states as the agent does (feed.py).
Checked: no node ever holds more than its in-flight cap, no tenant gets more than its limit,
nothing is left booked in Redis afterwards, and a node drained by its agent is seen drained by
every sidecar within `CONVERGE_S`.

"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from pathlib import Path

import aiohttp
import pytest
import redis

from admission.store import keys
from devstack.procs import sidecars
from loadtest.bench_scale import Agents
from tests.test_cluster import cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.cluster

NODES, SIDECARS, SECONDS, HOLD_S = 512, 8, 6.0, 1.0
# Asks per second, both edges (the rate). On the 2-core machine CI runs on, 8 sidecars,
# 3 Redis masters, the agents and this generator share the cores: 6,000 asks were sent in
# 6.0–6.3 s in seven runs (once in 8.9 s on a busier day); MANY_SIDECARS_RATE lowers it.
RATE = int(os.environ.get("MANY_SIDECARS_RATE", "1000"))
CAP = 2  # in-flight per node: 1,024 slots for ~800 held admissions a second × HOLD_S
CONVERGE_S = (
    1.0  # a node's change is seen by every sidecar within this, load over (refresh ≤ 0.5 s)
)
LOADED_CONVERGE_S = 15.0  # ... and under the load, on a 2-core machine that also runs the load
ASK_UNTIL_S = 60.0  # the sidecars are asked this long for when they saw it
LIMITED_RPS, LIMITED_BURST = 20, 10  # tenant t3's limit (the others' do not bind)

POLICY = """
redis: {{url: "{url}", cluster: true, pool_size: 64, command_timeout_ms: 1000}}
watermarks: {{stale_after_s: 3}}
queue: {{max_depth: 100000, max_depth_per_tenant: 100000}}
classes: {{realtime: {{weight: 1, priority: 0, deadline_s: 3}}}}
tenants:
  t0: {{keys: ["plain:k0"], limits: {{requests_per_s: 1000, request_burst: 1000, tokens_per_min: 1000000000, token_burst: 100000000}}}}
  t1: {{keys: ["plain:k1"], limits: {{requests_per_s: 1000, request_burst: 1000, tokens_per_min: 1000000000, token_burst: 100000000}}}}
  t2: {{keys: ["plain:k2"], limits: {{requests_per_s: 1000, request_burst: 1000, tokens_per_min: 1000000000, token_burst: 100000000}}}}
  t3: {{keys: ["plain:k3"], limits: {{requests_per_s: {rps}, request_burst: {burst}, tokens_per_min: 1000000000, token_burst: 100000000}}}}
nodes:
{nodes}
"""


class Run:
    def __init__(self, socks: list[str]) -> None:
        self.socks = socks
        self.held: collections.Counter[str] = collections.Counter()
        self.worst: collections.Counter[str] = collections.Counter()
        self.admitted: collections.Counter[str] = collections.Counter()
        self.answers: collections.Counter[str] = collections.Counter()
        self.releases: list[asyncio.Task[None]] = []
        self.start = self.t3_until = 0.0

    async def ask(self, sessions: list[aiohttp.ClientSession], i: int) -> None:
        edge = i % 2  # two edges, four sidecars each
        s = sessions[edge * 4 + (i // 2) % 4]
        tenant = f"t{i % 4}"
        body = {"tenant": tenant, "model": "m", "prompt_tokens": 50, "max_tokens": 50}
        async with s.post("http://sidecar/admit", json=body) as r:
            data = await r.json()
        if tenant == "t3":  # its debit was before its answer (the client may send it late)
            self.t3_until = max(self.t3_until, time.monotonic())
        if r.status != 200:
            self.answers[f"{r.status} {data['error']['code']}"] += 1
            return
        self.answers["admitted"] += 1
        self.admitted[tenant] += 1
        node = data["node"]
        self.held[node] += 1
        self.worst[node] = max(self.worst[node], self.held[node])
        await asyncio.sleep(HOLD_S)
        self.held[node] -= 1  # before the release is sent: never more than the server holds
        usage = {"prompt_tokens": 50, "completion_tokens": 20}
        rel = {"ticket": data["ticket"], "status": 200, "usage": usage}
        async with s.post("http://sidecar/release", json=rel) as r2:
            assert r2.status == 200, await r2.text()

    async def converge(self, agents: Agents, node: int) -> float:
        """Node `node`'s agent publishes it drained; seconds until every sidecar saw it (each
        says when: `state_since` in /nodes, the same host's clock)."""
        agents.drain_node.value = node  # then "not yet": the agents publish it, and say when
        agents.drained_at.value = 0.0
        agents.drain.set()
        while not agents.drained_at.value:  # noqa: ASYNC110 (another process sets it)
            await asyncio.sleep(0.005)
        at = agents.drained_at.value
        name = f"n{node}"

        async def seen(sock: str) -> float:
            # A connection of its own: not in line behind the asks in the load's pools (asked
            # through them, a late client gave up at 15 s on sidecars that had seen it).
            conn = aiohttp.UnixConnector(path=sock, limit=1)
            async with aiohttp.ClientSession(connector=conn) as s:
                last = None
                while time.time() - at < ASK_UNTIL_S:
                    async with s.get("http://sidecar/nodes") as resp:
                        data = await resp.json()
                    for n in data["nodes"]:  # when the sidecar saw it (not when this client asked)
                        if n["node"] == name:
                            last = {**n, "views_age_s": data["views_age_s"]}
                            if n["state"] == "drain":
                                return float(n["state_since"]) - at
                    await asyncio.sleep(0.02)
            raise AssertionError(f"{sock} never saw {name} drained: {last}")

        return max(await asyncio.gather(*(seen(sock) for sock in self.socks)))

    async def drive(self, agents: Agents) -> tuple[float, float, float]:
        sessions = [
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=p, limit=256))
            for p in self.socks
        ]
        try:
            tasks, start, converged = [], time.monotonic(), None
            self.start = start
            for i in range(int(RATE * SECONDS)):
                due = start + i / RATE
                if (delay := due - time.monotonic()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self.ask(sessions, i)))
                if i == int(RATE * SECONDS / 2):
                    converged = asyncio.create_task(self.converge(agents, 256))
            sent_s = time.monotonic() - start
            results = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, errors[:3]
            assert converged is not None
            loaded = await converged
            await asyncio.sleep(1.0)  # the load over
            return sent_s, loaded, await self.converge(agents, 128)
        finally:
            for s in sessions:
                await s.close()


def test_eight_sidecars_two_edges_cluster_512_nodes(
    cluster: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    nodes = "\n".join(
        f'  n{i}: {{url: "http://127.0.0.1:{20000 + i}", models: [m], memory_source: kv,'
        f" max_inflight: {CAP}}}"
        for i in range(NODES)
    )
    policy = tmp_path / "policies.yaml"
    policy.write_text(POLICY.format(url=cluster, nodes=nodes, rps=LIMITED_RPS, burst=LIMITED_BURST))
    agents = Agents(cluster, NODES, cluster=True)
    agents.start()
    socks = [str(tmp_path / f"s{k}.sock") for k in range(SIDECARS)]
    try:
        time.sleep(0.5)  # the first states are in
        with sidecars(policy, socks, tmp_path / "logs") as logs:
            time.sleep(1.0)
            run = Run(socks)
            sent_s, loaded_s, converged_s = asyncio.run(run.drive(agents))

            total = sum(run.answers.values())
            print(
                f"asks {total} in {sent_s:.1f} s: {dict(run.answers)}; a drain seen by all in "
                f"{loaded_s * 1000:.0f} ms under the load, {converged_s * 1000:.0f} ms after it; "
                f"busiest node held {max(run.worst.values())}; t3 admitted {run.admitted['t3']}, "
                f"its last answer at {run.t3_until - run.start:.1f} s"
            )
            assert total == RATE * SECONDS
            # The cluster did take the load: t0–t2 (no limit binds them) got at least a third of
            # what they asked. Not all: at ~800 held a second the 1,024 slots turn over only as
            # fast as releases reach Redis and the sidecars' views, and on this 2-core machine
            # the rest wait past deadline_s (503 queue_timeout): about 2,600–3,900 of their
            # 4,500 admitted in ten runs (asks sent in 6.1–8.2 s); in 20 more, 1,825–3,900 —
            # the low end in CI, after the rest of the suite, which failed the half it asked
            # for (all four tenants' admissions, the code before this wave's lease fixes beside
            # the new, four runs each: 2,981–3,825 and 2,940–4,179).
            free = run.admitted["t0"] + run.admitted["t1"] + run.admitted["t2"]
            assert free >= total * 3 / 4 / 3, run.admitted
            assert max(run.worst.values()) <= CAP, run.worst.most_common(3)
            assert run.answers["429 requests_per_s"] > 0  # t3's limit bound ...
            # ... held, over the time its debits were made: each before its answer. Not over
            # the time the asks were created: this client's pools (256 connections each) send
            # them late while the admitted ones are held, so debits go on after `sent_s` (a
            # bound of 20 × (sent_s + 2) + 10 broke once leases were no longer left behind and
            # more asks were admitted and held: 191–228 admitted, 185–206 allowed).
            bound = LIMITED_RPS * (run.t3_until - run.start) + LIMITED_BURST
            assert run.admitted["t3"] <= bound
            assert converged_s <= CONVERGE_S and loaded_s <= LOADED_CONVERGE_S
            # Nothing left booked: every lease released, every ledger back to zero.
            r = redis.RedisCluster.from_url(cluster)
            try:
                left = {
                    f"n{n}": r.zrange(keys.node_leases(f"n{n}"), 0, -1, withscores=True)
                    for n in range(NODES)
                    if r.zcard(keys.node_leases(f"n{n}"))
                }
                kv = [n for n in range(NODES) if int(r.hget(keys.node_ledger(f"n{n}"), "kv") or 0)]
            finally:  # redis-py 8.1's close() leaves the nodes' sockets to the garbage collector
                for node in r.get_nodes():  # (a ResourceWarning then, which fails the session)
                    node.redis_connection.connection_pool.disconnect()
                r.close()
            # The tickets left (request id : node : tenant [: a]) and their expiry name the path.
            assert not left and not kv, (list(left.items())[:5], kv[:5])
            text = "".join(log.read_text() for log in logs)
            bad = ("failure mode open", "Traceback", "giving back lease")
            assert not any(b in text for b in bad), text[-3000:]
    finally:
        agents.stop.set()
        agents.join(5)
