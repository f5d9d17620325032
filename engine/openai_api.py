"""The emulator's reading of OpenAI-compatible request bodies, its answers' bodies, and
vLLM's error body."""

from __future__ import annotations

import json
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
        text = "".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
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


def err_body(msg: str, code: int = 400) -> str:
    return json.dumps(
        {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": code}
    )


def full_body(
    body: dict[str, Any], chat: bool, rid: str, created: int, model: str, n: int, finish: Any
) -> dict[str, Any]:
    """A non-streamed answer of `n` generated tokens, usage aside. Chat `logprobs` (with
    `top_logprobs` alternatives per token) as vLLM writes them: large answers come from there."""
    tokens = [f" tok{i}" for i in range(n)]
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(tokens), "refusal": None}
        if body.get("logprobs"):
            top = int(body.get("top_logprobs") or 0)

            def entry(t: str, lp: float) -> dict[str, Any]:
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            choice["logprobs"] = {
                "content": [
                    {
                        **entry(t, -0.01),
                        "top_logprobs": [entry(f" alt{k}", -1.0 - k) for k in range(top)],
                    }
                    for t in tokens
                ]
            }
    else:
        choice["text"] = "".join(tokens)
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
