"""The node agent: one per GPU host. Samples NVML and the host's vLLM, publishes node state.

Every `period_s` for each node it serves: read GPU memory (NVML, or the emulator's simulated
device), scrape vLLM `/metrics` and `/health`, compute the effective memory fraction, apply the
watermark state machine, and write one JSON state to Redis with a TTL of `stale_after_s`, so a
silent agent reads as a down node, and tell the change feed what moved (feed.py). Sidecars read
these; they never scrape engines.

One job over 350 lines: one node's tick — sample, judge against the watermarks, publish —
shares its figures from end to end; registration and the memory readers are modules of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from admission.nodes import feed, memory, registry
from admission.nodes.feed import Publisher
from admission.nodes.gpu import GpuReader, NvmlReader, SimulatedGpuReader
from admission.nodes.rates import Booking, PrefillRate, PrefillSpeed, PrefixHits, Tpot
from admission.nodes.state import NodeState
from admission.nodes.watermarks import DOWN, OPEN, next_state
from admission.policy import Node, Policy
from admission.store import Call, Scripts, keys

log = logging.getLogger(__name__)


@dataclass
class EngineSample:
    kv_usage: float | None = None
    running: int = 0
    waiting: int = 0
    preemptions: float = 0.0
    kv_pool_bytes: int | None = None
    kv_tokens: int | None = None  # KV pool capacity in tokens (blocks × block size)
    prompt_tokens: float | None = None  # vllm:prompt_tokens_total (prefill tokens processed)
    prompt_cached: float | None = None  # vllm:prompt_tokens_cached_total (of those, cached)
    prefill_s: float | None = None  # vllm:request_prefill_time_seconds_sum (finished requests)
    prefill_computed: float | None = None  # vllm:request_prefill_kv_computed_tokens_sum (same)
    generation_tokens: float | None = None  # vllm:generation_tokens_total
    prefix_queries: float | None = None  # vllm:prefix_cache_queries_total (prompt tokens)
    prefix_hits: float | None = None  # vllm:prefix_cache_hits_total (of those, found cached)


def parse_vllm_metrics(text: str) -> EngineSample:
    """Pick what admission needs out of vLLM's Prometheus text (summed over engines)."""
    s = EngineSample()
    for fam in text_string_to_metric_families(text):
        for sm in fam.samples:
            if sm.name == "vllm:kv_cache_usage_perc":
                s.kv_usage = max(s.kv_usage or 0.0, sm.value)
            elif sm.name == "vllm:num_requests_running":
                s.running += int(sm.value)
            elif sm.name == "vllm:num_requests_waiting":
                s.waiting += int(sm.value)
            elif sm.name == "vllm:generation_tokens_total":
                s.generation_tokens = (s.generation_tokens or 0.0) + sm.value
            elif sm.name == "vllm:prompt_tokens_total":
                s.prompt_tokens = (s.prompt_tokens or 0.0) + sm.value
            elif sm.name == "vllm:request_prefill_time_seconds_sum":
                s.prefill_s = (s.prefill_s or 0.0) + sm.value
            elif sm.name == "vllm:request_prefill_kv_computed_tokens_sum":
                s.prefill_computed = (s.prefill_computed or 0.0) + sm.value
            elif sm.name == "vllm:prompt_tokens_cached_total":
                s.prompt_cached = (s.prompt_cached or 0.0) + sm.value
            elif sm.name == "vllm:prefix_cache_queries_total":
                s.prefix_queries = (s.prefix_queries or 0.0) + sm.value
            elif sm.name == "vllm:prefix_cache_hits_total":
                s.prefix_hits = (s.prefix_hits or 0.0) + sm.value
            elif sm.name == "vllm:num_preemptions_total":
                s.preemptions += sm.value
            elif sm.name == "vllm:cache_config_info":
                blocks = sm.labels.get("num_gpu_blocks")
                size = sm.labels.get("block_size")
                if blocks not in (None, "None", "") and size not in (None, "None", ""):
                    s.kv_tokens = int(float(blocks)) * int(float(size))
                mem = sm.labels.get("kv_cache_memory_bytes")
                if mem not in (None, "None", ""):
                    s.kv_pool_bytes = int(float(mem))
    return s


def computed(engine: EngineSample) -> float | None:
    """Prompt tokens the engine really computed: vllm:prompt_tokens_total counts whole prompts,
    the part found in its prefix cache (vllm:prefix_cache_hits_total) included. The ledger books
    only the uncached part as pending prefill, so the rate that drains it must count the same:
    a rate with the hits in it drained the ledger faster than the node (conversations mix:
    realtime TTFT p50 5 s with every node inside its prefill budget)."""
    if engine.prompt_tokens is None:
        return None
    # vllm:prompt_tokens_cached counts with prompt_tokens (when a prefill completes); the prefix
    # cache's hits count when a request is scheduled, so the difference of those two dips
    # while long prompts run. The latter only for an engine without the former (older vLLM releases).
    cached = engine.prompt_cached if engine.prompt_cached is not None else engine.prefix_hits
    return engine.prompt_tokens - (cached or 0.0)


# A node whose engine has nothing waiting has at most this long of its prefill rate pending:
# prompts on their way there, and the rest of chunked prefills running (a 6,000-token prompt
# takes ~0.7 s on an A100; half a second of its rate covers most of what is left of it).
CLAMP_S = 0.5


class NodeProbe:
    """Samples one node and keeps its watermark state between samples."""

    def __init__(
        self, node: Node, session: aiohttp.ClientSession, gpu: GpuReader | None, timeout_s: float
    ) -> None:
        self.node = node
        self.session = session
        self.gpu = gpu
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.state = DOWN
        self.seq = 0
        self.prefill = PrefillRate()
        self.speed = PrefillSpeed()
        self.tpot = Tpot()
        self.prefix = PrefixHits()
        self.booking = Booking()
        self._warned: set[str] = set()

    async def sample(self, policy: Policy, booked: float | None = None) -> NodeState:
        """`booked`: the prefill tokens the node's ledger has booked in all (its `pb` counter;
        None: not known)."""
        node = self.node
        self.seq += 1
        wanted = node.memory_source
        try:
            async with self.session.get(f"{node.url}/health", timeout=self.timeout) as r:
                healthy = r.status == 200
            async with self.session.get(f"{node.url}/metrics", timeout=self.timeout) as r:
                engine = parse_vllm_metrics(await r.text()) if r.status == 200 else EngineSample()
            gpu = await self.gpu.read(node.gpus) if self.gpu is not None else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as exc:
            self.state = DOWN
            return NodeState.down(node.id, self.seq, wanted.value, type(exc).__name__)
        inputs = memory.Inputs(
            gpu, engine.kv_usage, node.kv_pool_bytes or engine.kv_pool_bytes, engine.kv_tokens
        )
        src = memory.fallback(wanted, inputs)
        if src != wanted:
            self._warn_once(
                f"{node.id}: memory_source {wanted.value} lacks inputs, using {src.value}"
            )
        reader = memory.SOURCES[src]
        try:
            fraction = reader.fraction(inputs)
        except ValueError as exc:
            self.state = DOWN
            return NodeState.down(node.id, self.seq, src.value, str(exc), healthy=healthy)
        self.state = next_state(self.state, fraction, policy.watermarks) if healthy else DOWN
        per_token = reader.per_token(inputs)
        now = time.monotonic()
        kv_in_use = (engine.kv_usage or 0.0) * (engine.kv_tokens or 0) * per_token
        return NodeState(
            node=node.id,
            seq=self.seq,
            state=self.state,
            source=src.value,
            healthy=healthy,
            memory=round(fraction, 5),
            per_token=per_token,
            base_memory=round(max(0.0, fraction - kv_in_use), 5),
            prefill_rate=round(self._prefill_rate(engine, booked), 1),
            tpot_s=round(self.tpot.update(now, engine.generation_tokens, engine.running), 5),
            decode_s=round(self.tpot.decode_s, 5),
            kv_usage=engine.kv_usage,
            kv_pool_tokens=engine.kv_tokens,
            prefix_hit_ratio=self.prefix.update(engine.prefix_queries, engine.prefix_hits),
            running=engine.running,
            waiting=engine.waiting,
            preemptions=engine.preemptions,
            gpu_used_bytes=gpu.used_bytes if gpu else None,
            gpu_total_bytes=gpu.total_bytes if gpu else None,
        )

    def _prefill_rate(self, engine: EngineSample, booked: float | None) -> float:
        """The rate at which the node clears the prefill its ledger books (rates.Booking): the
        better of its throughput between completions and its requests' own prefill speed."""
        now, done = time.monotonic(), computed(engine)
        factor = self.booking.update(now, booked, done, engine.waiting)
        rate = self.prefill.update(now, done, busy=engine.running + engine.waiting > 0)
        speed = self.speed.update(now, engine.prefill_computed, engine.prefill_s)
        return max(rate, speed) * factor

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning(msg)


class Agent:
    """Publishes the state of `node_ids` (default: every node in the policy) to Redis."""

    def __init__(
        self,
        redis: Any,
        policy: Policy,
        node_ids: list[str] | None = None,
        period_s: float = 0.2,
        registration: tuple[Node, bytes, dict[str, Any]] | None = None,
    ) -> None:
        self.redis = redis
        # (the node it registers, the discovery secret, the spec it signs: what it was given,
        # the rest left to the policy's discovery.defaults)
        self.registration = registration
        if registration is not None:  # it watches that node alone, as a policy node
            node = registration[0]
            policy = dataclasses.replace(policy, nodes={**policy.nodes, node.id: node})
            node_ids = [node.id]
        self.policy = policy
        self.node_ids = node_ids
        self.period_s = period_s
        self.nvml = NvmlReader()
        if not self.nvml.available:
            log.warning("no NVML on this host: nodes use their device_url or KV usage alone")
        self._probes: dict[str, NodeProbe] = {}
        self.publisher = Publisher()  # the state keys, and what is news on the change feed
        self._pb: dict[str, float] = {}  # node → its ledger's prefill booked, as of the last tick
        self.scripts = Scripts(redis)  # the ledger's pending prefill, cut (lua/pending_clamp.lua)

    def _probe(self, node: Node, session: aiohttp.ClientSession) -> NodeProbe:
        p = self._probes.get(node.id)
        if p is None or p.node != node:
            gpu: GpuReader | None
            if node.device_url:
                gpu = SimulatedGpuReader(session, node.device_url)
            else:
                gpu = self.nvml if self.nvml.available else None
            p = NodeProbe(node, session, gpu, timeout_s=max(0.2, self.period_s * 2))
            self._probes[node.id] = p
        return p

    async def tick(self, session: aiohttp.ClientSession) -> list[NodeState]:
        nodes = [
            n for n in self.policy.nodes.values() if not self.node_ids or n.id in self.node_ids
        ]
        states = await asyncio.gather(
            *(self._probe(n, session).sample(self.policy, self._pb.get(n.id)) for n in nodes)
        )
        pipe = self.redis.pipeline(transaction=False)
        stale_s = self.policy.watermarks.stale_after_s
        self.publisher.publish(pipe, list(states), time.monotonic(), stale_s)
        if self.registration is not None:
            registry.heartbeat(pipe, self.registration[0].id)
        # Each ledger's prefill booked (lease.lua's `pb`), for the next sample's rates: read in
        # the same round trip, a tick late (the estimate spans ~20 s).
        for n in nodes:
            pipe.hget(keys.node_ledger(n.id), "pb")
        got = await pipe.execute()
        counts = got[len(got) - len(nodes) :]
        self._pb = {n.id: float(v or 0) for n, v in zip(nodes, counts, strict=True)}
        # Engine truth for pending prefill: a node with nothing waiting has at most CLAMP_S of
        # its rate pending. Through Scripts (NOSCRIPT reloads, Redis Cluster), one round trip.
        cuts = [
            Call("pending_clamp", [keys.node_ledger(st.node)], [st.prefill_rate, cap])
            for st in states
            if st.healthy and st.waiting == 0 and (cap := int(st.prefill_rate * CLAMP_S)) > 0
        ]
        if cuts:
            await self.scripts.run(*cuts)
        return list(states)

    def reload_policy(self, path: str) -> None:
        """SIGHUP (`systemctl reload`): read the policy again — the nodes to watch, their memory
        sources, the watermarks; a bad file is logged and the running policy kept."""
        from admission.errors import PolicyError
        from admission.policy import load_policy

        try:
            policy = load_policy(path)
            if self.registration is not None:  # the node it registered stays its node
                node = self.registration[0]
                policy = dataclasses.replace(policy, nodes={**policy.nodes, node.id: node})
            self.policy = policy
            log.info("agent: policy %s reloaded", path)
        except PolicyError as exc:
            log.error("agent: policy %s rejected, keeping the running one:", path)
            for problem in exc.problems:
                log.error("  %s", problem)

    async def run(self, stop: asyncio.Event, grace_s: float = 0.0) -> None:
        """Sample until `stop`; a registered node then leaves gracefully (`leave`)."""
        async with aiohttp.ClientSession() as session:
            if self.registration is not None:
                await self.register()
            last: dict[str, str] = {}
            checked = time.monotonic()
            while not stop.is_set():
                try:
                    for st in await self.tick(session):
                        if last.get(st.node) != st.state:
                            log.info("node %s: %s (memory %s)", st.node, st.state, st.memory)
                            last[st.node] = st.state
                    if self.registration is not None and time.monotonic() - checked > 10:
                        checked = time.monotonic()  # forgotten (a Redis flush): again
                        if not await self.redis.hexists(keys.REGISTRY, self.registration[0].id):
                            await self.register()
                except Exception as exc:  # keep sampling through Redis blips
                    log.error("agent tick failed: %s", exc)
                try:
                    await asyncio.wait_for(stop.wait(), self.period_s)
                except TimeoutError:
                    pass
            if self.registration is not None:
                await self.leave(session, grace_s)
        self.nvml.close()

    async def register(self) -> None:
        """Sign and write the node's registration; a drain left by its last leave is cleared
        (the node is back)."""
        assert self.registration is not None
        node, secret, spec = self.registration
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(keys.node_admin(node.id))
        feed.add(pipe, node.id, "a", "")
        await pipe.execute()
        await registry.register(self.redis, secret, node.id, spec)
        log.info("node %s registered (%s, models %s)", node.id, node.url, ", ".join(node.models))

    async def leave(self, session: aiohttp.ClientSession, grace_s: float) -> None:
        """Graceful leave (SIGTERM: a preStop, a spot notice, a rolling upgrade): drain the node
        — every sidecar routes nothing new there from its next refresh —, keep its state fresh
        while its leases end (up to `grace_s`), then deregister. The drain stays until the node
        registers again, so no sidecar routes there between the two."""
        node = self.registration[0] if self.registration else None
        if node is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(keys.node_admin(node.id), "drain")
        feed.add(pipe, node.id, "a", "drain")
        await pipe.execute()
        deadline = time.monotonic() + grace_s
        left = await self.redis.zcard(keys.node_leases(node.id))
        log.warning("node %s leaving: drained; %d request(s) to end (%ss)", node.id, left, grace_s)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(self.period_s)
            try:
                await self.tick(session)
                left = await self.redis.zcard(keys.node_leases(node.id))
            except Exception as exc:
                log.error("agent tick failed while leaving: %s", exc)
        await registry.deregister(self.redis, node.id)
        log.warning("node %s deregistered (%d request(s) still running)", node.id, left)


__all__ = ["OPEN", "Agent", "EngineSample", "NodeProbe", "parse_vllm_metrics"]
