"""The emulator's reading of OpenAI-compatible request bodies, its answers' bodies, and
vLLM's error body."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from aiohttp import web


class Tokens:
    """Prompts counted as a real node counts them: its tokenizer (a `tokenizer.json`) over the
    chat template it serves (engine.vllm_node.CHAT_TEMPLATE, rendered here by hand), for a
    profile fitted to that node. The ids then key the prefix cache, as vLLM's do."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # with the load extras; only fitted profiles need it

        self._tok = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def chat(self, msgs: list[Any]) -> list[int]:
        text = "".join(
            f"<|{m.get('role', 'user')}|> {m.get('content', '')}\n"
            for m in msgs
            if isinstance(m, dict)
        )
        return self.encode(text + "<|assistant|> ")


# What a chat template renders from the body besides its messages, as the emulator keys it.
_RENDERED = ("tools", "functions", "documents", "chat_template", "chat_template_kwargs")
_MESSAGE_PLAIN = ("role", "content")


def _rendered(body: dict[str, Any]) -> str:
    return "".join(json.dumps(body[k], sort_keys=True) for k in _RENDERED if k in body)


def _extra(m: dict[str, Any]) -> str:
    """A message's fields a template renders beside its content (name, tool calls, a tool
    message's id, reasoning): part of the prompt, so of its cache key."""
    rest = {k: v for k, v in m.items() if k not in _MESSAGE_PLAIN}
    return json.dumps(rest, sort_keys=True) if rest else ""


def prompt_of(
    body: dict[str, Any], chat: bool, tokens: Tokens | None = None
) -> tuple[int, str | list[int]]:
    """Prompt tokens as the emulator counts them (4 characters each, plus 4 per chat message;
    or with `tokens`, the real node's tokenizer), and what its prefix cache sees (the text, or
    the token ids)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise web.HTTPBadRequest(
                text=err_body("messages must be a non-empty list"), content_type="application/json"
            )
        if tokens is not None:
            ids = tokens.chat(msgs)
            return max(1, len(ids)), ids
        text = _rendered(body) + "".join(
            str(m.get("content", "")) + _extra(m) for m in msgs if isinstance(m, dict)
        )
        return max(1, len(text) // 4 + 4 * len(msgs)), text
    prompt = body.get("prompt")
    if not isinstance(prompt, str | list):
        raise web.HTTPBadRequest(
            text=err_body("prompt must be a string"), content_type="application/json"
        )
    if isinstance(prompt, str):
        if tokens is not None:
            ids = tokens.encode(prompt)
            return max(1, len(ids)), ids
        return max(1, len(prompt) // 4), prompt
    return max(1, len(prompt)), prompt if all(isinstance(t, int) for t in prompt) else ""


# Where a prompt says how long its answer is: the emulator's stand-in for a model that ends its
# answer (EOS, finish_reason "stop") before the client's max_tokens, as most answers do. The
# load generator writes it at the end of a prompt whose kind sets a cap above its answers
# (loadtest.workloads.mix `max_tokens`); no real model reads it.
ANSWER_MARK = "[answer {} tokens]"
_ANSWER = re.compile(r"\[answer (\d+) tokens\]\s*$")


def answer_length(body: dict[str, Any], chat: bool) -> int | None:
    """The answer length the prompt's end asks for (ANSWER_MARK), None when it asks none."""
    if chat:
        msgs = body.get("messages")
        last = msgs[-1] if isinstance(msgs, list) and msgs else None
        text = last.get("content") if isinstance(last, dict) else None
    else:
        text = body.get("prompt")
    m = _ANSWER.search(text) if isinstance(text, str) else None
    return max(1, int(m.group(1))) if m else None


def err_body(msg: str, code: int = 400) -> str:
    return json.dumps(
        {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": code}
    )


def _entry(t: str, lp: float) -> dict[str, Any]:
    return {"token": t, "logprob": lp, "bytes": list(t.encode())}


def _alts(top: int) -> list[dict[str, Any]]:
    return [_entry(f" alt{k}", -1.0 - k) for k in range(top)]


def logprobs_of(body: dict[str, Any], tokens: list[str]) -> dict[str, Any] | None:
    """A chat choice's `logprobs` for `tokens`, as vLLM writes them when asked (`logprobs`,
    `top_logprobs` alternatives per token); None when not asked."""
    if not body.get("logprobs"):
        return None
    alts = _alts(int(body.get("top_logprobs") or 0))
    return {"content": [{**_entry(t, -0.01), "top_logprobs": alts} for t in tokens]}


def logprobs_json(body: dict[str, Any], tokens: list[str]) -> str:
    """`json.dumps(logprobs_of(body, tokens))` for a stream chunk, with the alternatives' text
    made once (a chunk with 20 alternatives a token is mostly these; dumping them anew for
    every token made the emulator's CPU, not the engine model, the bottleneck of large
    answers)."""
    if not body.get("logprobs"):
        return "null"
    alts = _alts_json(int(body.get("top_logprobs") or 0))
    # Each entry's own JSON, its closing brace opened again for the alternatives.
    entries = ",".join(
        f'{json.dumps(_entry(t, -0.01))[:-1]}, "top_logprobs": {alts}}}' for t in tokens
    )
    return f'{{"content": [{entries}]}}'


@functools.lru_cache(maxsize=32)
def _alts_json(top: int) -> str:
    return json.dumps(_alts(top))


def full_body(
    body: dict[str, Any],
    chat: bool,
    rid: str,
    created: int,
    model: str,
    outs: list[tuple[int, Any]],
) -> dict[str, Any]:
    """A non-streamed answer, usage aside: a choice per sequence, `outs` its (generated tokens,
    finish reason). Chat `logprobs` (with `top_logprobs` alternatives per token) as vLLM writes
    them: large answers come from there (and from n)."""
    choices = []
    for index, (n, finish) in enumerate(outs):
        tokens = [f" tok{i}" for i in range(n)]
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        if chat:
            content = "".join(tokens)
            choice["message"] = {"role": "assistant", "content": content, "refusal": None}
            choice["logprobs"] = logprobs_of(body, tokens)
        else:
            choice["text"] = "".join(tokens)
        choices.append(choice)
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
