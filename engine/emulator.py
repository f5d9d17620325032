"""A vLLM-compatible emulated node: vLLM's OpenAI API and metrics over `engine.scheduler`.

Speaks /v1/completions and /v1/chat/completions (JSON and SSE, with the final usage chunk under
stream_options.include_usage), /v1/models, /health, /version and /metrics with vLLM's names.
Extra, for tests and the node agent: GET /sim/device (the simulated GPU: NVML-like used/total
bytes, with the KV pool pre-allocated like vLLM does) and POST /sim/fault (leak, hang, errors,
drop: close connections unanswered, crash). Run: `python -m engine --port 8101`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.openai_api import MAX_MODEL_LEN, err_body, full_body, prompt_of
from engine.profiles import PROFILES, Profile
from engine.scheduler import Scheduler, Seq, block_hashes

LAT = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Engine:
    """Runs the scheduler in real time and exposes what vLLM would."""

    def __init__(self, profile: Profile, policy: str = "priority", num_blocks: int | None = None,
                 model_name: str | None = None, max_queued_tokens: int = 0,
                 max_queued_reqs: int = 0, prefix_caching: bool = True) -> None:  # fmt: skip
        self.profile = profile
        # vLLM 0.32's admission valves (0 = off): requests waiting + running, and prompt tokens
        # still to prefill; past either, a new request is answered 503 (shed, not queued).
        self.max_queued_tokens = max_queued_tokens
        self.max_queued_reqs = max_queued_reqs
        self.model = model_name or profile.model
        self.sched = Scheduler(profile, policy, num_blocks, prefix_caching)
        self.wake = asyncio.Event()
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
        }
        # Not a vLLM metric: lets tests see the priority field the edge delivered.
        # Not a vLLM metric: lets edge tests prove that client-sent internal headers never
        # reach an engine.
        self.m_spoofed = Counter(
            "sim_internal_headers", "Requests that arrived with a client X-Tenant* header.",
            registry=r,
        )  # fmt: skip
        self.m_prio = Counter(
            "emulator_requests_by_priority", "Requests by priority field.", ["priority"], registry=r
        )
        self.h = {
            k: Histogram(n, d, names, buckets=LAT, registry=r).labels(**lab)
            for k, (n, d) in hist.items()
        }
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["block_size", "num_gpu_blocks", "gpu_memory_utilization", "kv_cache_memory_bytes",
                      "engine"], registry=r)  # fmt: skip
        info.labels(
            str(profile.block_size), str(self.sched.num_blocks), str(profile.gpu_memory_utilization),
            str(self.sched.num_blocks * profile.block_size * profile.kv_bytes_per_token), "0",
        ).set(1)  # fmt: skip

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.sched.idle() or self.hang:
                self.wake.clear()
                await self.wake.wait()
                continue
            started = loop.time()
            res = self.sched.step(time.monotonic())
            self.m_prompt.inc(res.prefill_tokens + res.cached)  # vLLM counts whole prompts
            self.m_cache_q.inc(res.queried)
            self.m_cache_hit.inc(res.cached)
            self.m_gen.inc(len(res.decoded))
            self.m_preempt.inc(res.preempted)
            self.m_running.set(len(self.sched.running))
            self.m_waiting.set(len(self.sched.waiting))
            self.m_kv.set(self.sched.kv_usage)
            # Real time: the step's cost minus what computing it took.
            await asyncio.sleep(max(0.0, res.duration_s - (loop.time() - started)))
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

    def abort(self, seq: Seq) -> None:
        if seq.finish_reason is None:
            self.sched.abort(seq)
            self.m_success.labels("0", self.model, "abort").inc()

    def device(self) -> dict[str, int]:
        p = self.profile
        used = (
            p.weights_bytes
            + p.activation_bytes
            + self.sched.num_blocks * p.block_size * p.kv_bytes_per_token
        )
        used += self.leak_bytes + p.context_bytes
        return {"used_bytes": min(used, p.total_bytes), "total_bytes": p.total_bytes}


ENGINE = web.AppKey("engine", Engine)


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    chat = request.path.endswith("/chat/completions")
    if any(h.lower().startswith("x-tenant") for h in request.headers):
        engine.m_spoofed.inc()
    try:
        body = await request.json()
    except json.JSONDecodeError:
        raise web.HTTPBadRequest(
            text=err_body("invalid JSON"), content_type="application/json"
        ) from None
    if engine.drop and request.transport is not None:  # dies mid-request: no answer at all
        request.transport.abort()
        raise web.HTTPInternalServerError()
    if engine.error_rate and random.random() < engine.error_rate:
        raise web.HTTPInternalServerError(
            text=err_body("injected error", 500), content_type="application/json"
        )
    if body.get("model") not in (engine.model, None):
        raise web.HTTPNotFound(text=err_body(f"The model `{body.get('model')}` does not exist.", 404),
                               content_type="application/json")  # fmt: skip
    # As vLLM reads them: max_completion_tokens wins on chat; with neither set, a chat request
    # generates up to the model's length (MAX_MODEL_LEN here), a completion 16 tokens.
    max_tokens = (
        (chat and body.get("max_completion_tokens")) or body.get("max_tokens")
        or (MAX_MODEL_LEN if chat else 16)
    )  # fmt: skip
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise web.HTTPBadRequest(
            text=err_body("max_tokens must be at least 1"), content_type="application/json"
        )
    prompt, text = prompt_of(body, chat)
    seq = Seq(prompt, max_tokens, priority=int(body.get("priority", 0)), arrival=time.monotonic())
    if engine.sched.prefix_caching:
        seq.hashes = block_hashes(text, engine.profile.block_size)
    engine.m_prio.labels(str(seq.priority)).inc()
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": 0,
        "total_tokens": prompt,
    }
    stream = bool(body.get("stream"))
    # vLLM with --enable-request-id-headers echoes the caller's X-Request-Id.
    echo = (
        {"X-Request-Id": request.headers["X-Request-Id"]}
        if "X-Request-Id" in request.headers
        else {}
    )
    queue: asyncio.Queue[int] = asyncio.Queue()
    if stream:
        seq.on_token = lambda s: queue.put_nowait(s.generated)
    else:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_token(s: Seq) -> None:
            if s.finish_reason and not done.done():
                done.set_result(None)

        seq.on_token = on_token
    try:
        engine.submit(seq)
    except OverflowError:
        raise web.HTTPServiceUnavailable(
            text=err_body("engine queue full", 503), content_type="application/json"
        ) from None
    try:
        if not stream:
            await done
            if chat and body.get("tools") and body.get("tool_choice") == "required":
                # vLLM parses a required tool call only once it is generated: text that is not
                # a JSON list of calls (the emulator's always) is a 400, after the work is done.
                msg = err_body("output is not a valid tool call list")
                raise web.HTTPBadRequest(text=msg, content_type="application/json")
            usage.update(
                completion_tokens=seq.generated,
                total_tokens=prompt + seq.generated,
                prompt_tokens_details={"cached_tokens": max(0, seq.cached_tokens)},
            )
            doc = full_body(
                body, chat, rid, created, engine.model, seq.generated, seq.finish_reason
            )
            return web.json_response({**doc, "usage": usage}, headers=echo)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **echo}
        )
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str, finish: str | None, first: bool = False) -> bytes:
            c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                c["delta"] = (
                    {"role": "assistant", "content": delta} if first else {"content": delta}
                )
            else:
                c["text"] = delta
            d = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": engine.model,
                "choices": [c],
            }
            return b"data: " + json.dumps(d).encode() + b"\n\n"

        if chat:
            await resp.write(chunk("", None, first=True))
        sent = 0
        while sent < seq.max_tokens:
            n = await queue.get()
            parts = "".join(f" tok{i}" for i in range(sent, n))
            sent = n
            await resp.write(chunk(parts, seq.finish_reason if sent >= seq.max_tokens else None))
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            usage.update(
                completion_tokens=sent,
                total_tokens=prompt + sent,
                prompt_tokens_details={"cached_tokens": max(0, seq.cached_tokens)},
            )
            d = {"id": rid, "object": obj, "created": created, "model": engine.model,
                 "choices": [], "usage": usage}  # fmt: skip
            await resp.write(b"data: " + json.dumps(d).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        engine.abort(seq)  # the client went away: vLLM aborts the request
        raise


async def models(request: web.Request) -> web.Response:
    e = request.app[ENGINE]
    return web.json_response({"object": "list", "data": [{"id": e.model, "object": "model", "owned_by": "vllm",
                                                          "max_model_len": 8192}]})  # fmt: skip


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE].hang:
        await asyncio.sleep(3600)
    return web.Response()


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=generate_latest(request.app[ENGINE].registry), content_type="text/plain"
    )


async def device(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].device())


async def fault(request: web.Request) -> web.Response:
    e = request.app[ENGINE]
    body = await request.json()
    e.leak_bytes = int(body.get("leak_bytes", e.leak_bytes))
    e.hang = bool(body.get("hang", e.hang))
    e.error_rate = float(body.get("error_rate", e.error_rate))
    e.drop = bool(body.get("drop", e.drop))
    if body.get("crash"):
        os._exit(1)
    e.wake.set()
    return web.json_response({"leak_bytes": e.leak_bytes, "hang": e.hang,
                              "error_rate": e.error_rate, "drop": e.drop})  # fmt: skip


def build_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=8 << 20)
    app[ENGINE] = engine

    async def loop_ctx(app: web.Application) -> Any:
        task = asyncio.create_task(engine.run(), name="engine-loop")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(loop_ctx)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", lambda _r: _version())
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/device", device)
    app.router.add_post("/sim/fault", fault)
    return app


async def _version() -> web.Response:
    return web.json_response({"version": "emulated"})


def serve(port: int, profile: str, policy: str, num_blocks: int | None, model: str | None,
          start_delay_s: float = 0.0, host: str = "127.0.0.1", max_queued_tokens: int = 0,
          max_queued_reqs: int = 0, prefix_caching: bool = True) -> None:  # fmt: skip
    if start_delay_s:
        time.sleep(start_delay_s)  # slow start: the port refuses connections meanwhile, like vLLM
    engine_args = (PROFILES[profile], policy, num_blocks, model, max_queued_tokens,
                   max_queued_reqs, prefix_caching)  # fmt: skip

    async def main() -> None:
        app = build_app(Engine(*engine_args))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
