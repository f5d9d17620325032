"""A vLLM-compatible emulated node: vLLM's OpenAI API and metrics over `engine.scheduler`.

The engine itself (its scheduler, metrics and simulated device: NVML-like used/total bytes,
with the KV pool pre-allocated like vLLM does, and the faults tests inject: leak, hang, errors,
drop, crash); its HTTP side, vLLM's OpenAI API, is engine/api.py. Run: `python -m engine
--port 8101`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.profiles import Profile
from engine.scheduler import Scheduler, Seq

LAT = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CATCH_UP_S = 0.05  # behind the model's timeline by more than this: the time is lost, not caught up
STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Engine:
    """Runs the scheduler in real time and exposes what vLLM would."""

    def __init__(
        self,
        profile: Profile,
        policy: str = "priority",
        num_blocks: int | None = None,
        model_name: str | None = None,
        max_queued_tokens: int = 0,
        max_queued_reqs: int = 0,
        prefix_caching: bool = True,
    ) -> None:
        self.profile = profile
        # vLLM 0.32's admission valves (0 = off): requests waiting + running, and prompt tokens
        # still to prefill; past either, a new request is answered 503 (shed, not queued).
        self.max_queued_tokens = max_queued_tokens
        self.max_queued_reqs = max_queued_reqs
        self.model = model_name or profile.model
        self.total_blocks = num_blocks if num_blocks is not None else profile.num_blocks
        self.sched = Scheduler.pool(profile, policy, self.total_blocks, prefix_caching)
        self.wake = asyncio.Event()
        # A CPU engine (profile.device False): its API server shares the CPU with the engine
        # core, so each request's path (HTTP, tokenizing, IPC) delays the next step by as much.
        self.cpu_debt_s = 0.0
        self.leak_bytes = 0
        self.hang = False
        self.error_rate = 0.0
        self.drop = False
        r = self.registry = CollectorRegistry()
        lab = {"engine": "0", "model_name": self.model}
        names = list(lab)

        def g(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=r).labels(**lab)

        def c(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(**lab)

        self.m_running = g(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.m_waiting = g(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.m_kv = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.m_preempt = c("vllm:num_preemptions", "Cumulative preemptions.")
        self.m_prompt = c("vllm:prompt_tokens", "Prompt tokens of prefilled requests.")
        self.m_prompt_cached = c(
            "vllm:prompt_tokens_cached", "Cached prompt tokens of prefilled requests."
        )
        self.m_cache_q = c("vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.m_cache_hit = c("vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        self.m_gen = c("vllm:generation_tokens", "Generation tokens processed.")
        self.m_success = Counter(
            "vllm:request_success", "Finished requests.", [*names, "finished_reason"], registry=r
        )
        hist = {
            "ttft": ("vllm:time_to_first_token_seconds", "Time to first token."),
            "itl": ("vllm:inter_token_latency_seconds", "Inter-token latency (mean per request)."),
            "e2e": ("vllm:e2e_request_latency_seconds", "End-to-end request latency."),
            "queue": ("vllm:request_queue_time_seconds", "Time waiting before first scheduled."),
            "prefill": ("vllm:request_prefill_time_seconds", "First scheduled to first token."),
        }
        # Not a vLLM metric: lets tests see the priority field the edge delivered.
        # Not a vLLM metric: lets edge tests prove that client-sent internal headers never
        # reach an engine.
        self.m_spoofed = Counter(
            "sim_internal_headers",
            "Requests that arrived with a client X-Tenant* header.",
            registry=r,
        )
        # Not a vLLM metric: seconds this process fell behind its model's timeline (loadtest.
        # fidelity reports it: an emulator slower than its profile says so here).
        self.m_overrun = Counter(
            "sim_step_overrun_seconds", "Time the emulator lost behind its cost model.", registry=r
        )
        self.m_prio = Counter(
            "emulator_requests_by_priority", "Requests by priority field.", ["priority"], registry=r
        )
        self.h = {
            k: Histogram(n, d, names, buckets=LAT, registry=r).labels(**lab)
            for k, (n, d) in hist.items()
        }
        self.h_computed = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed (not found cached) per finished request.",
            names,
            buckets=(16, 64, 256, 1024, 4096, 16384, 65536),
            registry=r,
        ).labels(**lab)
        self.h_step = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            names,
            buckets=STEP_TOKENS,
            registry=r,
        ).labels(**lab)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "num_gpu_blocks",
                "gpu_memory_utilization",
                "kv_cache_memory_bytes",
                "engine",
            ],
            registry=r,
        )
        info.labels(
            str(profile.block_size),
            str(self.total_blocks),
            str(profile.gpu_memory_utilization),
            str(self.total_blocks * profile.block_size * profile.kv_bytes_per_token),
            "0",
        ).set(1)

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due: float | None = None  # when the last step's modeled time ended (None: idle since)
        while True:
            if self.sched.idle() or self.hang:
                self.wake.clear()
                await self.wake.wait()
                due = None
                self.cpu_debt_s = 0.0  # the request paths ran while the core had nothing to do
                continue
            # Steps follow one another on the model's timeline: a step starts when the last one
            # ended, not when this process finished streaming its tokens — in vLLM the engine
            # core steps on while the API server streams, and a fitted profile's step times
            # already hold what that streaming cost the node. A process too slow for the model
            # (over CATCH_UP_S behind) restarts the timeline and counts the time it lost.
            started = loop.time()
            base = started
            if due is not None:
                if started - due <= CATCH_UP_S:
                    base = due
                else:
                    self.m_overrun.inc(started - due)
            res = self.sched.step(time.monotonic())
            # vLLM counts a prompt once its prefill completes (the first token's output), whole:
            # a 7,000-token prompt is 0 for the ~0.8 s it takes, then 7,000 at once. Counted per
            # chunk here, a rate read from the counter was smooth where vLLM's is bursty.
            self.m_prompt.inc(res.first_prompts)
            self.m_prompt_cached.inc(res.first_prompts - res.first_computed)
            self.m_cache_q.inc(res.queried)  # lookups and hits: when a request is scheduled
            self.m_cache_hit.inc(res.cached)
            self.m_gen.inc(len(res.decoded))
            if res.prefill_tokens or res.decoded:  # one observation per step, as vLLM counts
                self.h_step.observe(res.first_computed + len(res.decoded))
            self.m_preempt.inc(res.preempted)
            self._gauges()
            due = base + res.duration_s + self.cpu_debt_s
            self.cpu_debt_s = 0.0
            await asyncio.sleep(max(0.0, due - loop.time()))
            for seq in res.decoded:
                if seq.on_token is not None:
                    seq.on_token(seq)
            for seq in res.finished:
                self._finished(seq)

    def _finished(self, seq: Seq) -> None:
        end = seq.finished_at or time.monotonic()
        self.m_success.labels("0", self.model, seq.finish_reason or "length").inc()
        self.h["e2e"].observe(end - seq.arrival)
        if seq.scheduled_at is not None:
            self.h["queue"].observe(seq.scheduled_at - seq.arrival)
        if seq.first_token_at is not None:
            self.h["ttft"].observe(seq.first_token_at - seq.arrival)
            if seq.scheduled_at is not None:  # as vLLM: observed together, when it finishes
                self.h["prefill"].observe(seq.first_token_at - seq.scheduled_at)
                self.h_computed.observe(seq.prompt_tokens - max(0, seq.cached_tokens))
            if seq.generated > 1:
                self.h["itl"].observe((end - seq.first_token_at) / (seq.generated - 1))

    def submit(self, seq: Seq) -> None:
        s = self.sched
        if self.max_queued_reqs and len(s.waiting) + len(s.running) >= self.max_queued_reqs:
            raise OverflowError("max_num_queued_reqs")
        if self.max_queued_tokens:
            pending = sum(q.prompt_tokens - q.computed for q in s.waiting) + sum(
                q.prompt_tokens - q.computed for q in s.running if q.in_prefill
            )
            if pending + seq.prompt_tokens > self.max_queued_tokens:
                raise OverflowError("max_num_queued_tokens")
        self.sched.add(seq)
        self.wake.set()

    async def request_path(self) -> None:
        """A request's way in before it can be scheduled (a fitted profile's
        `request_overhead_s`); on a CPU engine its CPU time is the engine core's too."""
        overhead = self.profile.request_overhead_s
        if overhead:
            if not self.profile.device:
                self.cpu_debt_s += overhead
            await asyncio.sleep(overhead)

    def abort(self, seq: Seq) -> None:
        if seq.finish_reason is None:
            self.sched.abort(seq)
            self.m_success.labels("0", self.model, "abort").inc()
            self._gauges()  # the loop may go idle now: no step would set them

    def _gauges(self) -> None:
        self.m_running.set(len(self.sched.running))
        self.m_waiting.set(len(self.sched.waiting))
        self.m_kv.set(self.sched.kv_usage)

    def device(self) -> dict[str, int]:
        p = self.profile
        used = (
            p.weights_bytes
            + p.activation_bytes
            + self.total_blocks * p.block_size * p.kv_bytes_per_token
        )
        used += self.leak_bytes + p.context_bytes
        return {"used_bytes": min(used, p.total_bytes), "total_bytes": p.total_bytes}
