"""End to end, what the engines did reaching the bill and the sidecars: prompt heads
fingerprinted and found cached, the engine's counts beside the edge's estimate, releases that
teach whichever sidecar they reach, and large answers settled (the stack of tests/test_e2e.py)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from devstack.stack import DEFAULT_POLICY, Stack
from tests.test_e2e import (
    ask_after,
    chat,
    learned,
    node_counter,
    ratio_figures,
    raw,
    refunded,
    stack,
)

pytestmark = pytest.mark.timeout(180)
__all__ = ["stack"]  # the module-scoped stack fixture: one of its own here


def test_a_shared_system_prompt_is_fingerprinted_booked_once_and_found_cached(
    stack: Stack,
) -> None:
    """The edge fingerprints the prompt head; the node that computed it holds its blocks in the
    Redis ledger (resident after release, nothing left booked), and a request that shares it
    finds it in that engine's prefix cache."""
    import redis as sync_redis

    from admission.store import keys
    from devstack.probes import wait_unbooked

    system = "You are the support assistant of a large company. " * 90  # ~4,500 characters
    before = sum(node_counter(stack, p, "vllm:prefix_cache_hits_total") for p in stack.node_ports)
    # The two sidecars learn each other's placements with their node refresh (the prefix
    # feed: 0.1 s busy, 0.5 s idle); the next request may reach the other one.
    ask_after(stack, system, 3, pause_s=0.7)
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        resident = [r.zcard(keys.node_prefixes(n)) for n in ("node-0", "node-1")]
    finally:
        r.close()
    assert max(resident) >= 8  # 4,500 characters: 8 full blocks of 512
    hits = sum(node_counter(stack, p, "vllm:prefix_cache_hits_total") for p in stack.node_ports)
    assert hits - before >= 2 * 1000  # the 2nd and 3rd found ~1,100 tokens computed
    assert wait_unbooked(stack.redis_url) == {}


def test_the_engines_cached_tokens_reach_the_sidecar_through_the_edge(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The release the edge sends carries the engine's cached prompt tokens in the engine's
    shape (`usage.prompt_tokens_details.cached_tokens`): the sidecar prices them at the
    tenant's `cached_token_price` and shows them beside what it booked as cached. Before, the
    edge renamed them and no release through the edge carried them (0 found here). One sidecar:
    the predicted-vs-found line compares a release only on the sidecar that booked it."""
    s = Stack(DEFAULT_POLICY, tmp_path_factory.mktemp("cached"), nodes=1, sidecars=1)
    try:
        s.start()
        system = "You are the billing assistant of a large company. " * 90
        ask_after(s, system, 2)
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(f"{s.sidecar_url}/status.json", timeout=5) as r:
                prefix = json.loads(r.read())["prefix"]
            if (prefix["engine_cached_tokens"] or 0) >= 1000 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert (prefix["engine_cached_tokens"] or 0) >= 1000, prefix  # the 2nd found ~1,100
        assert (prefix["booked_cached_tokens"] or 0) >= 1000, prefix
    finally:
        s.stop()


def test_pending_prefill_follows_the_engine_when_it_finds_more_cached_than_booked(
    stack: Stack,
) -> None:
    """Identical prompts shorter than one fingerprint block: the ledger books each whole, the
    engine computes each once and then finds it cached. Drained at the computed rate alone,
    the ledger's pending prefill grew without bound (60,775 tokens, 77 s of booked wait, after
    10 s of 24 such clients, on a node with nothing waiting); the agent's factor (booked ÷
    computed) drains it as the node does: the booked wait stays under the TTFT target."""
    import concurrent.futures

    body = chat(messages=[{"role": "user", "content": "x" * 200}], max_tokens=16)
    stop_at = time.monotonic() + 8.0

    def loop() -> int:
        n = 0
        while time.monotonic() < stop_at:
            status, _h, _b = raw(stack, body)
            n += status == 200
            time.sleep(0.2)  # 12 clients × ~2–4/s: inside acme's 50 requests/s
        return n

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        served = sum(pool.map(lambda _i: loop(), range(12)))
    assert served > 150
    with urllib.request.urlopen(f"{stack.sidecar_url}/nodes", timeout=5) as r:
        nodes = json.loads(r.read())["nodes"]
    for n in nodes:
        assert n["waiting"] == 0, n  # the engines kept up: nothing is really pending
        booked_wait = n["pending_prefill_tokens"] / max(1.0, n["prefill_rate"])
        assert booked_wait < 1.0, n


def test_the_edge_sends_its_prompt_estimate_beside_the_engines_count(stack: Stack) -> None:
    """The release carries the edge's estimate (`edge.chars_per_token`); the sidecar observes
    the engine's count over it. The emulator counts 4 characters a token, as the shipped policy
    estimates: the ratio is near 1 (a tokenizer far from it raises AdmissionTokenEstimateOff)."""
    before = ratio_figures(stack)
    for i in range(3):
        body = chat(messages=[{"role": "user", "content": f"question {i}: " + "word " * 400}])
        assert raw(stack, body)[0] == 200
    deadline = time.monotonic() + 10
    while (now := ratio_figures(stack))[0] < before[0] + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    count, total = now[0] - before[0], now[1] - before[1]
    assert count >= 3
    assert 0.9 < total / count < 1.1, total / count


def test_every_release_teaches_the_sidecar_it_reaches_whichever_admitted_it(stack: Stack) -> None:
    """The edge spreads releases over the two sidecars; each names the request's model and
    class, so the sidecar that takes it learns the answer's length even when the other one
    admitted it. Without the names, only the releases that reached their own sidecar (about
    half) would be learned. The answers end on their own (finish_reason stop: the edge reads it
    and says so); one cut at its cap would teach nothing."""
    from engine.openai_api import ANSWER_MARK

    key = ("llama-3-8b", "batch", "globex")
    before, sent = learned(stack, *key), 24
    for i in range(sent):
        content = f"teach {i} " + ANSWER_MARK.format(4)
        body = chat(messages=[{"role": "user", "content": content}], max_tokens=6)
        status, _h, _b = raw(
            stack, body, key="sk-demo-globex", headers={"X-Request-Class": "batch"}
        )
        assert status == 200
    deadline = time.monotonic() + 15
    while (got := learned(stack, *key) - before) < sent and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got == sent


def test_usage_of_an_answer_over_a_mebibyte_is_read_and_settled(stack: Stack) -> None:
    """`top_logprobs: 20` makes a plain answer larger than the edge parses whole (1 MiB): its
    usage is found as the body passes, and the charge settled to it (an image part is booked
    as 765 tokens, the engine counts far fewer: refunded). Dropped, the answer was a 200 whose
    prompt estimate was never settled."""
    content = [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": {"url": "data:,x"}},
    ]
    body = chat(
        messages=[{"role": "user", "content": content}],
        max_tokens=900,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=20,
    )
    before = refunded(stack, "acme")
    status, _h, out = raw(stack, body)
    assert status == 200 and len(out) > 1_048_576, (status, len(out))
    usage = json.loads(out)["usage"]
    assert usage["completion_tokens"] == 900
    for _ in range(50):  # the release is delivered just after the answer
        if refunded(stack, "acme") > before:
            break
        time.sleep(0.1)
    assert refunded(stack, "acme") - before > 700
