"""A fixed-latency OpenAI-compatible stub node for overhead benchmarks (not an engine model).

    python -m loadtest.stub --port P [--delay-ms 20]

Answers chat/completions after `--delay-ms` (or the body's `stub_delay_ms`) with a canned body and usage, /health 200, and a
/metrics with an idle KV cache so a node agent reports it open.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

BODY = json.dumps({
    "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}).encode()  # fmt: skip
METRICS = b'vllm:kv_cache_usage_perc{engine="0",model_name="stub"} 0.0\n'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=20)
    a = ap.parse_args()

    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        delay_ms = a.delay_ms
        if b"stub_delay_ms" in raw:  # a test holds one request open this long
            delay_ms = float(json.loads(raw).get("stub_delay_ms", delay_ms))
        await asyncio.sleep(delay_ms / 1000)
        return web.Response(body=BODY, content_type="application/json")

    async def ok(_r: web.Request) -> web.Response:
        return web.Response()

    async def metrics(_r: web.Request) -> web.Response:
        return web.Response(body=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", metrics)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
