"""Prompt text with the shape production traffic has for the engine's prefix cache, for the
locust users (locustfile.py): per-tenant system prompts that repeat, a user's own text that does
not, and conversations whose every turn resends the history. Apart from locust, so that tests
import it without locust's gevent patching."""

from __future__ import annotations

import random
import string
import uuid

_OWN = random.Random()  # users' own text: unseeded, shared by every user of the process


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text (three letters and a space: ~4 characters, which the edge
    and the emulated engine count as one token), drawn from `rng`."""
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=3)) for _ in range(tokens))


def system_prompt(tenant: str, kind: str, i: int, tokens: int) -> str:
    """The `i`-th system prompt of a tenant's `kind` of traffic, of about `tokens` tokens: the
    same text every time it is asked for (what the engine's prefix cache shares), different
    between tenants, kinds and i."""
    rng = random.Random(f"{tenant}/{kind}/{i}")
    return f"You are {tenant}'s {kind} assistant ({i}). " + words(rng, tokens)


def user_text(tokens: int) -> str:
    """A user's own text: different in every request from its first characters on, so nothing
    past the system prompt and the conversation's history is shared."""
    return f"[{uuid.uuid4().hex}] " + words(_OWN, max(0, tokens - 9))


class Conversation:
    """A chat's messages as its next turn sends them: the system prompt, every answered question
    followed by its answer, and the new question. A refused turn leaves no trace: the engine
    never computed it, and a chat client sends the question again without it."""

    def __init__(self, system: str) -> None:
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}]

    @property
    def turns(self) -> int:
        """Turns answered so far."""
        return (len(self.history) - 1) // 2

    def ask(self, question: str) -> list[dict[str, str]]:
        """The messages of the turn that asks `question`."""
        return [*self.history, {"role": "user", "content": question}]

    def answered(self, question: str, answer: str) -> None:
        """`question` was answered with `answer`: both go into every later turn."""
        self.history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
