"""Locust load test for any OpenAI-compatible endpoint behind the admission edge.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080
    locust -f loadtest/locustfile.py --host URL --headless -u 50 -r 10 -t 2m --csv out/run

Tenants and their API keys come from a policies file (LOCUST_POLICY, default: the policy
`admission up` runs; only `plain:` demo keys can be used — set LOCUST_KEYS='tenant=key,...' for
real ones). Users model three kinds of traffic, stream their answers, and report extra rows:
  TTFT <class>             time to first token, per request class
  refused <status> <code>  429/503 answers by reason (also counted as failures)

The traffic has the shape the engine's prefix cache meets in production, so that the capacity
found is neither a cache's best case nor its worst:
  - every request starts with one of its tenant's system prompts (LOCUST_PREFIXES per tenant
    and kind, default 4, of LOCUST_SYSTEM_TOKENS tokens, default 512): the same text each time;
  - what follows is the user's own text, different in every request;
  - chat (realtime) is a conversation of up to LOCUST_TURNS turns (default 6): each turn resends
    the history — every answered question with its answer, as streamed — and a new question.
    A refused turn is left out of the history, as a chat client asks again; then a new
    conversation starts. LOCUST_TURNS=1: single questions.
  - summarisation (batch) and offline jobs send one long document each.

Locust users are closed-loop (a user waits for its answer before its exponential think time),
which under overload slows the offered load down with the system. For overload measurements use
the open-loop benchmark (`python -m loadtest.bench`); use locust for interactive exploration and
capacity probing where the closed loop is what you want.
"""

from __future__ import annotations

import json
import os
import random
import time
from importlib import resources
from pathlib import Path
from typing import Any

from locust import HttpUser, between, events, task

from admission.policy import load_policy
from loadtest.workloads.prompts import Conversation, system_prompt, user_text

# Default: the policy shipped with the package (the one `admission up` runs).
POLICY = Path(os.environ.get("LOCUST_POLICY", str(resources.files("admission") / "policies.yaml")))
MODEL = os.environ.get("LOCUST_MODEL", "")
THINK_S = float(os.environ.get("LOCUST_THINK_S", "1.0"))
SYSTEM_TOKENS = int(os.environ.get("LOCUST_SYSTEM_TOKENS", "512"))
PREFIXES = max(1, int(os.environ.get("LOCUST_PREFIXES", "4")))
TURNS = max(1, int(os.environ.get("LOCUST_TURNS", "6")))


def _tenants() -> dict[str, dict[str, Any]]:
    policy = load_policy(POLICY)
    extra = dict(
        kv.split("=", 1) for kv in os.environ.get("LOCUST_KEYS", "").split(",") if "=" in kv
    )
    out = {}
    for t in policy.tenants.values():
        key = extra.get(t.id) or (t.demo_keys[0] if t.demo_keys else None)
        if key:
            out[t.id] = {"key": key, "classes": list(t.classes), "weight": t.weight}
    if not out:
        raise SystemExit(f"no usable keys in {POLICY}: add plain: keys or set LOCUST_KEYS")
    return out


TENANTS = _tenants()


class _Base(HttpUser):
    abstract = True
    wait_time = between(0, 2 * THINK_S)  # mean THINK_S
    cls = "realtime"
    kind = "chat"
    prompt_tokens = (50, 400)
    output_tokens = (30, 150)

    def on_start(self) -> None:
        candidates = [t for t, v in TENANTS.items() if self.cls in v["classes"]] or list(TENANTS)
        weights = [TENANTS[t]["weight"] for t in candidates]
        self.tenant = random.choices(candidates, weights)[0]
        self.headers = {
            "Authorization": f"Bearer {TENANTS[self.tenant]['key']}",
            "X-Request-Class": self.cls,
        }
        global MODEL
        if not MODEL:
            with self.client.get(
                "/v1/models", headers=self.headers, name="/v1/models", catch_response=True
            ) as r:
                data = r.json().get("data") or [{}] if r.status_code == 200 else [{}]
                MODEL = data[0].get("id", "llama-3-8b")
                r.success()

    def system(self) -> str:
        """One of this tenant's system prompts for this kind of traffic, at random."""
        return system_prompt(self.tenant, self.kind, random.randrange(PREFIXES), SYSTEM_TOKENS)

    def one(self) -> None:
        """A single request: a system prompt and a document of the user's own."""
        text = user_text(random.randint(*self.prompt_tokens))
        self._chat(
            [{"role": "system", "content": self.system()}, {"role": "user", "content": text}]
        )

    def _chat(self, messages: list[dict[str, str]]) -> str | None:
        """Send `messages`, streamed; the answer's text, or None if it was refused or failed."""
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": random.randint(*self.output_tokens),
            "stream": True,
        }
        start = time.perf_counter()
        name = f"chat {self.cls}"
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=self.headers,
            stream=True,
            name=name,
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                try:
                    code = r.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = "unknown"
                r.failure(f"{r.status_code} {code}")
                events.request.fire(
                    request_type="refused",
                    name=f"{r.status_code} {code}",
                    response_time=0,
                    response_length=0,
                    exception=None,
                    context={},
                )
                return None
            answer: list[str] = []
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                content = (choices[0].get("delta") or {}).get("content") if choices else None
                if not content:
                    continue
                if not answer:
                    events.request.fire(
                        request_type="TTFT",
                        name=self.cls,
                        response_time=(time.perf_counter() - start) * 1000,
                        response_length=0,
                        exception=None,
                        context={},
                    )
                answer.append(content)
            r.success()
            return "".join(answer)


class ChatUser(_Base):
    """Interactive chat, the realtime class: conversations of up to TURNS turns."""

    weight = 7
    cls = "realtime"

    def on_start(self) -> None:
        super().on_start()
        self.conversation = Conversation(self.system())

    @task
    def chat(self) -> None:
        if self.conversation.turns >= TURNS:
            self.conversation = Conversation(self.system())
        question = user_text(random.randint(*self.prompt_tokens))
        answer = self._chat(self.conversation.ask(question))
        if answer is not None:
            self.conversation.answered(question, answer)


class SummariseUser(_Base):
    """Long document summarisation: the batch class."""

    weight = 2
    cls = "batch"
    kind = "summarise"
    prompt_tokens = (2000, 6000)
    output_tokens = (100, 300)

    @task
    def summarise(self) -> None:
        self.one()


class OfflineUser(_Base):
    """Offline batch jobs: the offline class."""

    weight = 1
    cls = "offline"
    kind = "offline"
    prompt_tokens = (500, 2000)
    output_tokens = (200, 500)

    @task
    def job(self) -> None:
        self.one()
