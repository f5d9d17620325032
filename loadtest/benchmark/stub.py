"""A fixed-latency OpenAI-compatible stub node for overhead benchmarks (not an engine model).

    python -m loadtest.benchmark.stub --port P [--delay-ms 20]

Answers chat/completions after `--delay-ms` (or the body's `stub_delay_ms`) with a canned body and usage, /health 200, and a
/metrics with an idle KV cache so a node agent reports it open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
from pathlib import Path

from aiohttp import web

from devstack.procs import http_ok, wait_for
from devstack.stack import DEFAULT_POLICY, MODULES, Stack

BODY = json.dumps(
    {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
METRICS = b'vllm:kv_cache_usage_perc{engine="0",model_name="stub"} 0.0\n'


# The same stub as an NGINX with ngx_lua: ~15 µs of CPU per answer instead of the Python one's
# ~150, so that on a small box the stub takes little of the CPU the paths under test share
# (a real node is another machine).
NGINX_STUB_CONF = """daemon off; worker_processes 1; pid {d}/stub.pid; error_log {d}/stub-error.log warn;
{modules}
events {{ worker_connections 8192; }}
http {{
  access_log off; keepalive_requests 1000000;
  client_body_temp_path {d}/tmp;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location = /v1/chat/completions {{ default_type application/json; content_by_lua_block {{
      ngx.sleep({delay})
      ngx.print('{{"id":"chatcmpl-stub","object":"chat.completion","created":0,"model":"stub",'
        .. '"choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},'
        .. '"finish_reason":"stop"}}],"usage":{{"prompt_tokens":5,"completion_tokens":1,'
        .. '"total_tokens":6}}}}')
    }} }}
    location = /health {{ return 200; }}
    location = /metrics {{ default_type text/plain;
      return 200 'vllm:kv_cache_usage_perc{{engine="0",model_name="stub"}} 0.0\\n'; }}
  }}
}}
"""


def nginx_stub(work: Path, port: int, delay_ms: float) -> subprocess.Popen[bytes]:
    """Start the NGINX stub on 127.0.0.1:`port` (files under `work`); returns its master."""
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    modules = "\n".join(f"load_module {m};" for m in MODULES if Path(m).exists())
    (work / "stub.conf").write_text(
        NGINX_STUB_CONF.format(d=work, modules=modules, port=port, delay=delay_ms / 1000)
    )
    stub = subprocess.Popen(
        ["nginx", "-c", str(work / "stub.conf"), "-p", str(work)], start_new_session=True
    )
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 20, "stub", stub)
    return stub


def beside_plain_nginx(
    stub_port: int, direct_port: int, run_dir: Path, sidecars: int, ahead: bool = True
) -> Stack:
    """A stack (not started) whose one node is the stub at `stub_port`, one tenant (acme,
    `sk-demo-acme`) with its limits out of the way, and in the same NGINX a plain proxy to the
    stub on `direct_port`: the two paths the overhead benchmarks compare. `ahead`: the
    policy's `redis.answer_ahead`."""
    direct = f"""
    upstream bench_direct {{ server 127.0.0.1:{stub_port}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{direct_port} backlog=4096;
        location / {{ proxy_pass http://bench_direct; proxy_http_version 1.1;
                     proxy_set_header Connection ""; proxy_buffering off; }}
    }}"""
    nodes = {
        "stub": {
            "url": f"http://127.0.0.1:{stub_port}",
            "models": ["stub"],
            "memory_source": "kv",
            "max_inflight": 100000,
        }
    }
    tenants = {
        "acme": {
            "tier": "platinum",
            "keys": ["plain:sk-demo-acme"],
            "classes": ["realtime"],
            "models": ["stub"],
            "limits": {
                "requests_per_s": 100000,
                "request_burst": 100000,
                "tokens_per_min": 1e9,
                "token_burst": 100000000,
                "max_concurrent": 100000,
            },
        }
    }
    return Stack(
        DEFAULT_POLICY,
        run_dir,
        external_nodes=nodes,
        extra_nginx_http=direct,
        policy_overrides={"tenants": tenants, "redis": {"answer_ahead": ahead}},
        sidecars=sidecars,
    )


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
