"""The emulated node's HTTP side: vLLM's OpenAI API (/v1/completions and /v1/chat/completions,
JSON and SSE with the final usage chunk under stream_options.include_usage), /v1/models,
/health, /version and /metrics with vLLM's names, and the test hooks /sim/device and
/sim/fault, over one `emulator.Engine`. Run: `python -m engine --port 8101`.
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
from prometheus_client import generate_latest

from engine.emulator import Engine
from engine.openai_api import (
    Tokens,
    answer_length,
    err_body,
    full_body,
    logprobs_json,
    prompt_of,
)
from engine.profiles import PROFILES
from engine.scheduler import Seq, block_hashes

ENGINE = web.AppKey("engine", Engine)
TOKEN_ID0 = 100  # the id of every generated token, where a request asks for ids
LP_MARK = "\x00logprobs"  # where a chunk's logprobs JSON goes (built apart: logprobs_json)
LP_TEXT = json.dumps(LP_MARK)
TOKENS = web.AppKey("tokens", Tokens)


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
        raise web.HTTPNotFound(
            text=err_body(f"The model `{body.get('model')}` does not exist.", 404),
            content_type="application/json",
        )
    # As vLLM reads them: max_completion_tokens wins on chat; with neither set, a chat request
    # generates up to the model's length, a completion 16 tokens.
    max_tokens = (
        (chat and body.get("max_completion_tokens"))
        or body.get("max_tokens")
        or (engine.profile.max_model_len if chat else 16)
    )
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise web.HTTPBadRequest(
            text=err_body("max_tokens must be at least 1"), content_type="application/json"
        )
    copies = body.get("n") or 1
    if not isinstance(copies, int) or not 1 <= copies <= 128:
        raise web.HTTPBadRequest(
            text=err_body("n must be an integer from 1 to 128"), content_type="application/json"
        )
    prompt, text = prompt_of(body, chat, request.app.get(TOKENS))
    # n > 1: vLLM's parallel sampling, n sequences of one prompt (the copies find its blocks
    # cached), each up to max_tokens; the answer has a choice per sequence.
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise web.HTTPBadRequest(  # as vLLM answers it
            text=err_body("Parameter 'cache_salt' must be a non-empty string if provided."),
            content_type="application/json",
        )
    hashes = (
        block_hashes(text, engine.profile.block_size, salt) if engine.sched.prefix_caching else ()
    )
    arrival = time.monotonic()
    priority = int(body.get("priority", 0))
    # A prompt that asks for a shorter answer than max_tokens ends there: finish_reason "stop".
    length = min(max_tokens, answer_length(body, chat) or max_tokens)
    seqs = [
        Seq(
            prompt,
            length,
            priority=priority,
            arrival=arrival,
            hashes=hashes,
            stops=length < max_tokens,
        )
        for _ in range(copies)
    ]
    engine.m_prio.labels(str(seqs[0].priority)).inc()
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = bool(body.get("stream"))
    # vLLM with --enable-request-id-headers echoes the caller's X-Request-Id.
    echo = (
        {"X-Request-Id": request.headers["X-Request-Id"]}
        if "X-Request-Id" in request.headers
        else {}
    )
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def all_done(s: Seq) -> None:
        if all(q.finish_reason for q in seqs) and not done.done():
            done.set_result(None)

    for i, seq in enumerate(seqs):
        seq.on_token = (lambda s, i=i: queue.put_nowait((i, s.generated))) if stream else all_done
    await engine.request_path()
    submitted: list[Seq] = []
    try:
        for seq in seqs:
            engine.submit(seq)
            submitted.append(seq)
    except OverflowError:
        for seq in submitted:  # the copies the valve let in go too: the request is refused
            engine.abort(seq)
        raise web.HTTPServiceUnavailable(
            text=err_body("engine queue full", 503), content_type="application/json"
        ) from None

    def usage() -> dict[str, Any]:
        out = sum(q.generated for q in seqs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": out,
            "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": max(0, seqs[0].cached_tokens)},
        }

    try:
        if not stream:
            await done
            if chat and body.get("tools") and body.get("tool_choice") == "required":
                # vLLM parses a required tool call only once it is generated: text that is not
                # a JSON list of calls (the emulator's always) is a 400, after the work is done.
                msg = err_body("output is not a valid tool call list")
                raise web.HTTPBadRequest(text=msg, content_type="application/json")
            outs = [(q.generated, q.finish_reason) for q in seqs]
            doc = full_body(body, chat, rid, created, engine.model, outs)
            return web.json_response({**doc, "usage": usage()}, headers=echo)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **echo}
        )
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        ids = bool(body.get("return_token_ids"))

        def chunk(i: int, tokens: list[str], finish: str | None, first: bool = False) -> bytes:
            delta = "".join(tokens)
            c: dict[str, Any] = {"index": i, "logprobs": LP_MARK, "finish_reason": finish}
            if chat:
                c["delta"] = (
                    {"role": "assistant", "content": delta} if first else {"content": delta}
                )
            else:
                c["text"] = delta
            if ids:  # vLLM's `return_token_ids`: a chunk's ids (what the fit's probes count)
                c["token_ids"] = [TOKEN_ID0] * len(tokens)
            d = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": engine.model,
                "choices": [c],
            }
            lp = logprobs_json(body, tokens) if chat and tokens else "null"
            return b"data: " + json.dumps(d).replace(LP_TEXT, lp, 1).encode() + b"\n\n"

        if chat:
            for i in range(copies):
                await resp.write(chunk(i, [], None, first=True))
        sent = [0] * copies
        ended = [False] * copies
        while not all(ended):
            i, n = await queue.get()
            ended[i] = seqs[i].finish_reason is not None and n >= seqs[i].generated
            if n <= sent[i] and not ended[i]:
                continue
            parts = [f" tok{k}" for k in range(sent[i], n)]
            sent[i] = max(sent[i], n)
            await resp.write(chunk(i, parts, seqs[i].finish_reason if ended[i] else None))
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            d = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": engine.model,
                "choices": [],
                "usage": usage(),
            }
            await resp.write(b"data: " + json.dumps(d).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        for seq in seqs:
            engine.abort(seq)  # the client went away: vLLM aborts the request
        raise


async def embed(request: web.Request) -> web.Response:
    """/v1/embeddings as a pooling engine answers it: each input is prefilled (one engine step
    of its prompt, scheduled with the rest), nothing is generated; `usage` in OpenAI's shape
    (prompt and total tokens, no completion count)."""
    engine = request.app[ENGINE]
    try:
        body = await request.json()
    except json.JSONDecodeError:
        raise web.HTTPBadRequest(
            text=err_body("invalid JSON"), content_type="application/json"
        ) from None
    raw = body.get("input")
    inputs = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
    if not all(isinstance(x, str | list) and x for x in inputs):
        raise web.HTTPBadRequest(
            text=err_body("input must be a string or a list of them"),
            content_type="application/json",
        )
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seqs: list[Seq] = []

    def all_done(_s: Seq) -> None:
        if all(q.finish_reason for q in seqs) and not done.done():
            done.set_result(None)

    for x in inputs:
        n, _text = prompt_of({"prompt": x}, False, request.app.get(TOKENS))
        seqs.append(Seq(n, 1, priority=int(body.get("priority", 0)), arrival=time.monotonic()))
        seqs[-1].on_token = all_done
    await engine.request_path()
    for seq in seqs:
        engine.submit(seq)
    try:
        await done
    except asyncio.CancelledError:
        for seq in seqs:
            engine.abort(seq)
        raise
    prompt = sum(q.prompt_tokens for q in seqs)
    data = [
        {"object": "embedding", "index": i, "embedding": [round(random.random(), 6)] * 8}
        for i in range(len(seqs))
    ]
    return web.json_response(
        {
            "object": "list",
            "model": engine.model,
            "data": data,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        }
    )


async def models(request: web.Request) -> web.Response:
    e = request.app[ENGINE]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": e.model,
                    "object": "model",
                    "owned_by": "vllm",
                    "max_model_len": e.profile.max_model_len,
                }
            ],
        }
    )


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
    return web.json_response(
        {"leak_bytes": e.leak_bytes, "hang": e.hang, "error_rate": e.error_rate, "drop": e.drop}
    )


def build_app(engine: Engine, tokenizer: str = "") -> web.Application:
    """`tokenizer`: a real node's tokenizer.json, to count prompts as it does (fitted profiles)."""
    app = web.Application(client_max_size=8 << 20)
    app[ENGINE] = engine
    if tokenizer:
        app[TOKENS] = Tokens(tokenizer)

    async def loop_ctx(app: web.Application) -> Any:
        task = asyncio.create_task(engine.run(), name="engine-loop")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(loop_ctx)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/embeddings", embed)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/device", device)
    app.router.add_post("/sim/fault", fault)
    return app


async def version(_request: web.Request) -> web.Response:
    return web.json_response({"version": "emulated"})


def serve(
    port: int,
    profile: str,
    policy: str,
    num_blocks: int | None,
    model: str | None,
    start_delay_s: float = 0.0,
    host: str = "127.0.0.1",
    max_queued_tokens: int = 0,
    max_queued_reqs: int = 0,
    prefix_caching: bool = True,
    tokenizer: str = "",
) -> None:
    if start_delay_s:
        time.sleep(start_delay_s)  # slow start: the port refuses connections meanwhile, like vLLM
    engine_args = (
        PROFILES[profile],
        policy,
        num_blocks,
        model,
        max_queued_tokens,
        max_queued_reqs,
        prefix_caching,
    )

    async def main() -> None:
        app = build_app(Engine(*engine_args), tokenizer)
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
