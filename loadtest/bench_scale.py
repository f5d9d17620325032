"""Benchmark: what one sidecar costs as the cluster grows — CPU, latency, Redis commands.

    .venv/bin/python -m loadtest.bench_scale [--nodes 8,256,1024] [--seconds 8] [--rate 300]

For each cluster size: a fresh redis-server, `admission serve` on a unix socket with that many
nodes in its policy, and agents' publishing as the agent does it (nodes/feed.py's Publisher,
every 0.2 s; states that do not move, as on a steady cluster). Then, per size:
1. idle for `--seconds`: the sidecar's CPU (cores) and its Redis commands per second;
2. closed loop, `--concurrency` clients, each admission followed by its release: admissions/s
   and the sidecar's CPU per admission + release;
3. open loop at `--rate` admissions/s: /admit p50 / p99 as the load generator sees it, and the
   sidecar's own time from arrival to answer (`admission_decision_seconds`: the share within
   1 and 2 ms, its p99 bucket); `--pin` gives the sidecar a CPU of its own (the generator, the
   agents — at a lower priority: real ones run on the GPU hosts — and Redis share the others),
   so that the generator's lateness is not the sidecar's;
4. overload: open loop at twice what the closed loop carried, 16 tenants with a limit of
   `--tenant-rps` requests/s each: answers by kind, whether any came from fail-open (the
   sidecar's log), and whether any tenant got more than its limit admitted.
`--registered`: each size also with its nodes registered instead of listed (issue 65): the
policy lists none, its `discovery:` is on, and the same nodes are written to the registry as
`admission agent --register` writes them (signed), the agents heartbeating each tick.
The table compares sizes as ratios within one run (these machines are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import multiprocessing
import os
import subprocess
import time
from pathlib import Path

import aiohttp
import redis

from admission.nodes import registry
from admission.nodes.feed import Publisher
from admission.nodes.state import NodeState, Status
from admission.policy import load_policy
from admission.store import keys
from devstack.procs import RedisServer, sidecar_command, stop_process, wait_for
from loadtest import bench_admit
from loadtest.bench_admit import closed_loop
from loadtest.bench_edge import histograms_in, inside
from loadtest.benchmark.records import percentile
from loadtest.benchmark.scratch import add_flag, scratch

POLICY = bench_admit.POLICY.split("nodes:")[0] + "nodes:\n{nodes}\n"  # any number of nodes
DISCOVERY = 'discovery: {{enabled: true, allow: ["127.0.0.0/8"], secret_file: "{secret}"}}\n'
SECRET = b"bench-scale-registration-secret"
TENANT = (
    '  t{i}: {{keys: ["sha256:{d}"], limits: {{requests_per_s: {rps}, request_burst: {rps},'
    " tokens_per_min: 1000000000, token_burst: 100000000}}}}"
)
NODE = (
    '  n{i}: {{url: "http://127.0.0.1:{port}", models: [m], memory_source: kv, max_inflight: 256}}'
)
PERIOD_S = 0.2  # the agent's default period
DECISIONS = "admission_decision_seconds"
Hist = tuple[float, float, dict[float, float]]  # count, sum, cumulative buckets


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Agents(multiprocessing.Process):
    """Publishes every node's state each PERIOD_S as agents do (a process of its own, so that
    the load generator is not slowed); counts the commands it sends. `nice`: its scheduling
    niceness (real agents run on the GPU hosts, not beside the load generator)."""

    def __init__(
        self, url: str, n: int, cluster: bool = False, nice: int = 0, registered: bool = False
    ) -> None:
        super().__init__(daemon=True)
        self.url, self.n, self.cluster, self.nice = url, n, cluster, nice
        self.registered = registered  # also heartbeat each node's registration
        self.count = multiprocessing.Value("q", 0)
        self.stop = multiprocessing.Event()
        self.drain = multiprocessing.Event()  # set: node n{drain_node} is published drained
        self.drain_node = multiprocessing.Value("q", n // 2)
        self.drained_at = multiprocessing.Value("d", 0.0)  # time.time() of that publication

    @property
    def commands(self) -> int:
        return int(self.count.value)

    def run(self) -> None:
        if self.nice:
            os.nice(self.nice)
        r = (
            redis.RedisCluster.from_url(self.url)
            if self.cluster
            else redis.Redis.from_url(self.url)
        )
        states = [
            NodeState(node=f"n{i}", seq=1, state=Status.OPEN, source="kv", healthy=True, memory=0.2)
            for i in range(self.n)
        ]
        pub = Publisher()
        while not self.stop.is_set():
            draining = self.drain.is_set() and not self.drained_at.value  # once per pass
            if draining:
                i = int(self.drain_node.value)
                states[i] = NodeState(
                    node=f"n{i}", seq=2, state=Status.DRAIN, source="kv", healthy=True, memory=0.9
                )
            pipe = r.pipeline(transaction=False)
            told = pub.publish(pipe, states, time.monotonic(), 3.0)
            if self.registered:
                for st in states:
                    registry.heartbeat(pipe, st.node)
                told += len(states)
            pipe.execute()
            if draining:
                self.drained_at.value = time.time()
            with self.count.get_lock():
                self.count.value += len(states) + told
            self.stop.wait(PERIOD_S)


def commands(r: redis.Redis) -> int:
    return int(r.info("stats")["total_commands_processed"])


def redis_load(r: redis.Redis) -> tuple[int, float, int]:
    """Commands processed, CPU seconds used and bytes in + out, so far (INFO)."""
    info = r.info()
    cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    net = int(info["total_net_input_bytes"]) + int(info["total_net_output_bytes"])
    return int(info["total_commands_processed"]), cpu, net


async def ask(
    s: aiohttp.ClientSession, i: int, lat: list[float] | None, kinds: collections.Counter[str]
) -> None:
    body = {"tenant": f"t{i % 16}", "model": "m", "prompt_tokens": 50, "max_tokens": 100}
    t0 = time.perf_counter()
    async with s.post("http://sidecar/admit", json=body) as r:
        data = await r.json()
    if lat is not None:
        lat.append(time.perf_counter() - t0)
    code = (data.get("error") or {}).get("code") if r.status != 200 else None
    kinds[f"{r.status} {code}" if r.status != 200 else "admitted"] += 1
    if r.status == 200:
        kinds[f"admitted:t{i % 16}"] += 1
        usage = {"prompt_tokens": 50, "completion_tokens": 60}
        rel = {"ticket": data["ticket"], "status": 200, "usage": usage}
        async with s.post("http://sidecar/release", json=rel) as r2:
            await r2.read()


async def open_loop(
    sock: str, seconds: float, rate: float
) -> tuple[list[float], collections.Counter[str], float]:
    lat: list[float] = []
    kinds: collections.Counter[str] = collections.Counter()
    conn = aiohttp.UnixConnector(path=sock, limit=1024)
    late = 0.0
    async with aiohttp.ClientSession(connector=conn) as s:
        tasks = []
        start = time.perf_counter()
        for i in range(int(seconds * rate)):
            due = start + i / rate
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            late = max(late, time.perf_counter() - due)
            tasks.append(asyncio.create_task(ask(s, i, lat, kinds)))
        await asyncio.gather(*tasks, return_exceptions=True)
        kinds["_makespan_ms"] = int((time.perf_counter() - start) * 1000)  # first ask, last answer
    return lat, kinds, late


async def decision_times(sock: str) -> tuple[float, float, dict[float, float]]:
    """The sidecar's `admission_decision_seconds` so far: count, sum, cumulative buckets."""
    conn = aiohttp.UnixConnector(path=sock)
    async with aiohttp.ClientSession(connector=conn) as s, s.get("http://sidecar/metrics") as r:
        return histograms_in(await r.text())[DECISIONS]


def inside_shares(h0: Hist, h1: Hist) -> str:
    """Between two reads: bench_edge's mean and shares within 0.5 / 1 / 2 ms, and the bucket
    bound the 99th percentile falls under."""
    (c0, _s0, b0), (c1, _s1, b1) = h0, h1
    if c1 <= c0:
        return "–"
    p99 = next(le for le, c in sorted(b1.items()) if (c - b0.get(le, 0.0)) / (c1 - c0) >= 0.99)
    return f"{inside({DECISIONS: h0}, {DECISIONS: h1}, DECISIONS)}, p99 ≤ {p99 * 1000:g} ms"


def pin_rest(cpu: int) -> None:
    """This process (the load generator) and what it starts from now on (Redis, the agents)
    on every CPU but the sidecar's."""
    rest = set(range(os.cpu_count() or 1)) - {cpu}
    if rest:
        os.sched_setaffinity(0, rest)


def register_all(url: str, listed: Path) -> None:
    """Write every node of the `listed` policy to the registry, signed, as agents do."""
    r = redis.Redis.from_url(url)
    pipe = r.pipeline(transaction=False)
    now = int(time.time() * 1000)
    for node in load_policy(listed).nodes.values():
        pipe.hset(keys.REGISTRY, node.id, registry.signed(SECRET, node.id, registry.spec_of(node)))
        pipe.zadd(keys.REGISTRY_ALIVE, {node.id: now})
    pipe.incr(keys.REGISTRY_VERSION)
    pipe.execute()
    r.close()


def run_size(
    n: int, a: argparse.Namespace, work: Path, registered: bool = False
) -> dict[str, float | str]:
    name = f"{n}-registered" if registered else str(n)
    rs = RedisServer(work / f"redis-{name}")
    rs.start()
    policy = work / f"policies-{name}.yaml"
    tenants = "\n".join(
        TENANT.format(i=i, d=hashlib.sha256(f"k{i}".encode()).hexdigest(), rps=100000)
        for i in range(16)
    )
    nodes = "\n".join(NODE.format(i=i, port=10000 + i) for i in range(n))
    policy.write_text(POLICY.format(url=rs.url, tenants=tenants, nodes=nodes))
    extra = ""
    if registered:  # the same nodes, in the registry instead of the policy
        register_all(rs.url, policy)
        secret = work / "discovery.secret"
        secret.write_bytes(SECRET + b"\n")
        nodes, extra = "  {}", DISCOVERY.format(secret=secret)
        policy.write_text(POLICY.format(url=rs.url, tenants=tenants, nodes=nodes) + extra)
    sock = str(work / f"sidecar-{name}.sock")
    log = (work / f"sidecar-{name}.log").open("w")
    agents = Agents(rs.url, n, nice=10 if a.pin else 0, registered=registered)
    agents.start()
    cmd = sidecar_command(str(policy), sock, "info")
    cmd[1:1] = os.environ.get("BENCH_PY_ARGS", "").split()  # e.g. "-m cProfile -o FILE"
    if a.pin:
        cmd[:0] = ["taskset", "-c", str(a.pin_cpu)]
    proc = subprocess.Popen(
        cmd,
        start_new_session=True,
        stderr=log,
    )
    r = redis.Redis.from_url(rs.url)
    out: dict[str, float | str] = {"nodes": f"{n:,}" + (" registered" if registered else "")}
    try:
        wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 30, "sidecar")
        if proc.poll() is not None:
            raise SystemExit(f"the sidecar exited: {log.name}")
        time.sleep(3)  # its first full read, and the idle poll
        if registered:
            wait_for(lambda: f"{n} registered node(s)" in Path(log.name).read_text(), 30, "nodes")
        (c0, rc0, _n0), a0, t0 = redis_load(r), agents.commands, time.monotonic()
        cpu0 = cpu_s(proc.pid)
        time.sleep(a.seconds)
        dt = time.monotonic() - t0
        out["idle_cores"] = (cpu_s(proc.pid) - cpu0) / dt
        c1, rc1, _n1 = redis_load(r)
        out["idle_redis_cmds_s"] = (c1 - c0 - (agents.commands - a0) - 1) / dt
        out["idle_redis_cores"] = (rc1 - rc0) / dt  # the agents' writes and one sidecar's reads
        cpu0, (c0, rc0, n0), a0 = cpu_s(proc.pid), redis_load(r), agents.commands
        t0 = time.monotonic()
        ok, _fail = asyncio.run(closed_loop(sock, a.seconds, a.concurrency))
        dt = time.monotonic() - t0
        c1, rc1, n1 = redis_load(r)
        out["closed_per_s"] = ok / a.seconds
        out["cpu_us_per_admission"] = (cpu_s(proc.pid) - cpu0) / max(1, ok) * 1e6
        # Redis's part per admission + release, less what idling costs it over the same time.
        busy = (rc1 - rc0) - float(out["idle_redis_cores"]) * dt
        out["redis_us_per_admission"] = busy / max(1, ok) * 1e6
        out["redis_cmds_per_admission"] = (c1 - c0 - (agents.commands - a0) - 1) / max(1, ok)
        out["redis_bytes_per_admission"] = (n1 - n0) / max(1, ok)
        h0 = asyncio.run(decision_times(sock))
        lat, _kinds, late = asyncio.run(open_loop(sock, a.seconds, a.rate))
        h1 = asyncio.run(decision_times(sock))
        ms = [x * 1000 for x in lat]
        out["p50_ms"], out["p99_ms"], out["late_ms"] = (
            percentile(ms, 50),
            percentile(ms, 99),
            late * 1000,
        )
        out["inside"] = inside_shares(h0, h1)
        if a.overload:
            # Tenant limits low enough to bind: each tenant gets at most its rate (+ burst).
            tenants = "\n".join(
                TENANT.format(i=i, d=hashlib.sha256(f"k{i}".encode()).hexdigest(), rps=a.tenant_rps)
                for i in range(16)
            )
            policy.write_text(POLICY.format(url=rs.url, tenants=tenants, nodes=nodes) + extra)
            time.sleep(2)  # reloaded
            rate = 2 * max(out["closed_per_s"], 1.0)
            lat, kinds, late = asyncio.run(open_loop(sock, a.seconds, rate))
            admitted = [kinds[f"admitted:t{i}"] for i in range(16)]
            # A bucket admits at most its burst + rate × the time it was asked over: from the
            # first ask to the last answer (an answer may come late: asked again in line).
            makespan_s = kinds.pop("_makespan_ms") / 1000
            allowed = a.tenant_rps * makespan_s + a.tenant_rps
            log.flush()
            text = Path(log.name).read_text()
            out["overload_rate"] = rate
            out["overload_makespan_s"] = makespan_s
            out["overload_answers"] = ", ".join(
                f"{k} {v}" for k, v in sorted(kinds.items()) if not k.startswith("admitted:")
            )
            out["fail_open_lines"] = text.count("failure mode open")
            out["tenant_max_admitted"] = max(admitted)
            out["tenant_allowed"] = allowed
    finally:
        agents.stop.set()
        agents.join(5)
        stop_process(proc)
        rs.stop()
        r.close()
        log.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", default="8,256,1024")
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--rate", type=float, default=300)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--overload", action="store_true", help="also run the overload phase")
    ap.add_argument("--tenant-rps", type=float, default=20)
    ap.add_argument(
        "--registered", action="store_true", help="each size also with its nodes registered"
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the sidecar on the last CPU alone; the generator, agents and Redis on the others",
    )
    add_flag(ap)
    a = ap.parse_args()
    a.pin_cpu = (os.cpu_count() or 1) - 1
    if a.pin:
        pin_rest(a.pin_cpu)
    work = scratch("bench-scale-", a.keep_work)
    rows = []
    for n in a.nodes.split(","):
        rows.append(run_size(int(n), a, work))
        if a.registered:
            rows.append(run_size(int(n), a, work, registered=True))
    base = rows[0]
    print(
        "| nodes | sidecar CPU per admission + release | admissions + releases / s |"
        f" /admit p50 / p99 at {a.rate:.0f}/s | the same inside the sidecar | idle sidecar CPU |"
        " idle Redis commands/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ratio = float(row["cpu_us_per_admission"]) / float(base["cpu_us_per_admission"])
        print(
            f"| {row['nodes']} | {row['cpu_us_per_admission']:,.0f} µs ({ratio:.2f}×) |"
            f" {row['closed_per_s']:,.0f} | {row['p50_ms']:.2f} / {row['p99_ms']:.2f} ms"
            f" (send lateness ≤ {row['late_ms']:.1f} ms) | {row['inside']} |"
            f" {row['idle_cores']:.3f} cores |"
            f" {row['idle_redis_cmds_s']:,.0f} |"
        )
    print(
        "\n| nodes | Redis CPU per admission + release | Redis commands / bytes per admission +"
        " release | Redis CPU idle (agents + one sidecar) |"
    )
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['nodes']} | {row['redis_us_per_admission']:,.0f} µs |"
            f" {row['redis_cmds_per_admission']:.1f} / {row['redis_bytes_per_admission']:,.0f} |"
            f" {row['idle_redis_cores']:.3f} cores |"
        )
    for row in rows:
        if "overload_rate" in row:
            print(
                f"overload, {row['nodes']} nodes, {row['overload_rate']:,.0f}/s for {a.seconds:.0f} s"
                f" (last answer at {row['overload_makespan_s']:.1f} s): "
                f"{row['overload_answers']}; fail-open log lines {row['fail_open_lines']}; "
                f"most admitted for one tenant {row['tenant_max_admitted']} "
                f"(its limit allows {row['tenant_allowed']:,.0f})"
            )


if __name__ == "__main__":
    main()
