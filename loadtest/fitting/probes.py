"""The probes `loadtest.fit_engine` sends a real vLLM node, and what each measures.

Streamed completions with random prompts (no prefix-cache hits); `return_token_ids` tells how
many tokens a chunk carries, so a chunk that merged two steps counts as two. Each probe returns
`Sample`s: a step's prefill tokens, decodes, context tokens, requests waiting and seconds (a
prefill sample's seconds also hold the first token's path to the engine).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from engine.openai_api import Tokens
from engine.vllm_node import TINY_MODEL
from loadtest.workloads.mix import TINY, load_kinds, req_prompt, schedule


class Sample(NamedTuple):
    kind: str  # prefill, decode, mixed or queued
    prefill: int  # prompt tokens computed in the step
    decodes: int  # sequences decoding in the step
    context: int  # tokens of context held by the running sequences
    seconds: float
    waiting: int = 0  # requests queued in the engine behind the running ones


async def stream(
    s: aiohttp.ClientSession, url: str, prompt: list[int] | str, max_tokens: int
) -> tuple[float, list[tuple[float, int]]]:
    """Send one streamed completion (token ids, or text the node tokenizes as it would a chat's);
    (send time, [(arrival, tokens in chunk)]). `return_token_ids` says how many tokens a chunk
    carries (logprobs would too, but serialising them costs the node's API server — on the
    node's one CPU — more than the answers of the benchmarks do)."""
    body = {
        "model": TINY_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0, out = time.monotonic(), []
    async with s.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        pending = b""
        async for chunk in r.content.iter_any():
            now = time.monotonic()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"the node refused a probe: {event['error']}")
                    c = event["choices"]
                    n = len(c[0].get("token_ids") or []) if c else 0
                    if n:
                        out.append((now, n))
    return t0, out


VOCAB = [10, 500]  # token ids drawn (no special tokens); fit_engine sets the top: the vocab


def prompt(rng: random.Random, n: int) -> list[int]:
    """`n` random token ids; random from the first block on, so no probe finds another's prefix
    cached."""
    return [rng.randrange(*VOCAB) for _ in range(n)]


def text(rng: random.Random, n: int, tokens: Tokens) -> tuple[str, int]:
    """Random words the node's tokenizer counts as about `n` tokens: (text, its exact count).
    The first token's path then holds tokenizing, as a chat request's does."""
    words: list[str] = []
    while len(tokens.encode(" ".join(words))) < n:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)))
    out = " ".join(words)
    return out, len(tokens.encode(out))


async def probe(url: str, repeats: int, seed: int, tokens: Tokens) -> list[Sample]:
    rng = random.Random(seed)
    out: list[Sample] = []
    # No connection limit: aiohttp's default (100) held the `queued` probe's 64 + 400 streams
    # to 100 at once, so "400 waiting" had been 36 (found by tests/test_fit.py). Idle
    # connections closed before the node's server closes them (uvicorn: 5 s; aiohttp keeps
    # them 15 s and wrote a probe into one the node had just closed).
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=300)
    ) as s:
        for _ in range(3):  # warm up: first requests compile and allocate
            await stream(s, url, prompt(rng, 512), 8)
        for _ in range(repeats):
            for p in (8, 64, 256, 512, 768, 1024, 1536, 2000):
                words, n = text(rng, p, tokens)
                t0, toks = await stream(s, url, words, 4)
                out.append(Sample("prefill", n, 0, n, toks[0][0] - t0))
                await asyncio.sleep(0.05)
            for b, ln in ((1, 16), (1, 1500), (4, 16), (4, 1000), (8, 256), (16, 16), (16, 512)):
                out += await decode(s, url, rng, b, ln)
            for b, ln in ((32, 16), (32, 200), (64, 16), (64, 128)):
                out += await decode(s, url, rng, b, ln)
            for b, p in ((4, 256), (8, 1024), (16, 512), (32, 1536), (64, 256), (16, 1900)):
                out += await mixed(s, url, rng, b, p)
            for w in (0, 150, 400):
                out += await queued(s, url, rng, w)
    return out


async def queued(
    s: aiohttp.ClientSession, url: str, rng: random.Random, w: int, gen: int = 320
) -> list[Sample]:
    """64 streams decoding (the node's max_num_seqs) while `w` more requests wait behind them:
    what a queue inside the engine costs every step (its scheduler and API server keep books
    on each waiting request; under FIFO overload hundreds wait). Measured only once the engine
    reports all `w` waiting: while they arrive, their HTTP path runs on the node's CPU and
    slows its steps — a cost the emulator charges per request (`request_overhead_s`), which
    counted here too put 4–9 µs per waiting request per step, and made the emulated node step
    30 % slower than the real one where hundreds wait (docs/benchmarks.md)."""
    b, ln = 64, 16
    running = [asyncio.create_task(stream(s, url, prompt(rng, ln), gen)) for _ in range(b)]
    await asyncio.sleep(0.3)  # these hold the node's 64 slots first
    waiters = [asyncio.create_task(stream(s, url, prompt(rng, ln), 2)) for _ in range(w)]
    start = await waiting_reached(s, url, w)
    res = await asyncio.gather(*running)
    await asyncio.gather(*waiters)
    if start is None:
        return []
    step = step_time(res, start, min(toks[-1][0] for _, toks in res), least=8)
    return [Sample("queued", 0, b, b * (ln + gen // 2), step, w)] if step else []


async def waiting_reached(
    s: aiohttp.ClientSession, url: str, w: int, limit_s: float = 10.0
) -> float | None:
    """When the node's `vllm:num_requests_waiting` first reached `w` (polled every 20 ms, then
    no more: a scrape costs the node's CPU too); None if it did not within `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
        waiting = sum(
            float(ln.split()[-1])
            for ln in text.splitlines()
            if ln.startswith("vllm:num_requests_waiting")
        )
        if waiting >= w:
            return time.monotonic()
        await asyncio.sleep(0.02)
    return None


async def decode(
    s: aiohttp.ClientSession, url: str, rng: random.Random, b: int, ln: int, gen: int = 48
) -> list[Sample]:
    res = await asyncio.gather(*(stream(s, url, prompt(rng, ln), gen) for _ in range(b)))
    start = max(toks[0][0] for _, toks in res)  # every stream decodes from here on
    step = step_time(res, start, min(toks[-1][0] for _, toks in res), least=4)
    return [Sample("decode", 0, b, b * (ln + gen // 2), step)] if step else []


def step_time(
    res: list[tuple[float, list[tuple[float, int]]]], start: float, end: float, least: int
) -> float:
    """Seconds a step took while every stream of `res` decoded (between `start` and `end`):
    per stream, the time from its first to its last token in that window over the tokens in
    between (chunks the client read together carry one time: intervals alone would be 0),
    then the median over the streams; 0.0 when no stream had `least` tokens there."""
    steps: list[float] = []
    for _, toks in res:
        inside = [(t, n) for t, n in toks if start <= t <= end]
        tokens = sum(n for _t, n in inside[1:])
        if tokens >= least and inside[-1][0] > inside[0][0]:
            steps.append((inside[-1][0] - inside[0][0]) / tokens)
    return statistics.median(steps) if steps else 0.0


async def mixed(
    s: aiohttp.ClientSession, url: str, rng: random.Random, b: int, p: int, gen: int = 64
) -> list[Sample]:
    ln = 32
    decoders = [asyncio.create_task(stream(s, url, prompt(rng, ln), gen)) for _ in range(b)]
    await asyncio.sleep(0.3)  # the decoders are past their prefill
    _, new = await stream(s, url, prompt(rng, p), 2)
    res = await asyncio.gather(*decoders)
    # The step that prefilled the newcomer ended when its first token was sent; every decoder's
    # token of that step arrived about then too: each decoder's interval ending nearest to it.
    first = new[0][0]
    spans: list[float] = []
    for _, toks in res:
        near = min(
            itertools.pairwise(toks),
            key=lambda pair: abs(pair[1][0] - first),
            default=None,
        )
        if (
            near is not None
            and near[1][1] == 1
            and abs(near[1][0] - first) < 0.005
            and near[1][0] > near[0][0]
        ):
            spans.append(near[1][0] - near[0][0])
    if not spans:
        return []
    ctx = b * (ln + gen // 2) + p
    return [Sample("mixed", p, b, ctx, statistics.median(spans))]


async def token_check(url: str, tokenizer: Path, n: int = 40) -> dict[str, Any]:
    """Chat prompts of the tiny workloads: prompt_tokens from the node vs the emulator's count."""
    tokens = Tokens(str(tokenizer))
    kinds = TINY + load_kinds(str(Path(__file__).parent.parent / "workloads" / "tiny-prefix.yaml"))
    reqs = schedule(20, n / 20, seed=3, kinds=kinds)[:n]
    agree, worst = 0, 0.0
    async with aiohttp.ClientSession() as s:
        for r in reqs:
            msgs = [{"role": "user", "content": req_prompt(r, int(r.at_s * 1e6))}]
            body = {"model": TINY_MODEL, "messages": msgs, "max_tokens": 1}
            async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
                real = int((await resp.json())["usage"]["prompt_tokens"])
            mine = len(tokens.chat(msgs))
            agree += mine == real
            worst = max(worst, abs(mine - real) / real)
    return {"requests": len(reqs), "equal": agree, "worst_error": round(worst, 4)}
