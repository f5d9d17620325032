"""Locust load test for any OpenAI-compatible endpoint behind the admission edge.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080
    locust -f loadtest/locustfile.py --host URL --headless -u 50 -r 10 -t 2m --csv out/run

Tenants and their API keys come from a policies file (LOCUST_POLICY, default: the repository's
policies.yaml; only `plain:` demo keys can be used — set LOCUST_KEYS='tenant=key,...' for real
ones). Users model three kinds of traffic (short realtime chat, long document summarisation in
the batch class, offline batch jobs), stream their answers, and report extra rows:
  TTFT <class>          time to first token, per request class
  refused <status> <code>  429/503 answers by reason (also counted as failures)

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

# Default: the policy shipped with the package (the one `admission up` runs).
POLICY = Path(os.environ.get("LOCUST_POLICY", str(resources.files("admission") / "policies.yaml")))
MODEL = os.environ.get("LOCUST_MODEL", "")
THINK_S = float(os.environ.get("LOCUST_THINK_S", "1.0"))


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


def _text(tokens: int) -> str:
    return "lorem ipsum dolor " * (tokens // 4 + 1)


class _Base(HttpUser):
    abstract = True
    wait_time = between(0, 2 * THINK_S)  # mean THINK_S
    cls = "realtime"
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

    def _chat(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": _text(random.randint(*self.prompt_tokens))}],
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
                return
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        first = time.perf_counter()
                        events.request.fire(
                            request_type="TTFT",
                            name=self.cls,
                            response_time=(first - start) * 1000,
                            response_length=0,
                            exception=None,
                            context={},
                        )
            r.success()


class ChatUser(_Base):
    """Short interactive chat: the realtime class."""

    weight = 7
    cls = "realtime"

    @task
    def chat(self) -> None:
        self._chat()


class SummariseUser(_Base):
    """Long document summarisation: the batch class."""

    weight = 2
    cls = "batch"
    prompt_tokens = (2000, 6000)
    output_tokens = (100, 300)

    @task
    def summarise(self) -> None:
        self._chat()


class OfflineUser(_Base):
    """Offline batch jobs: the offline class."""

    weight = 1
    cls = "offline"
    prompt_tokens = (500, 2000)
    output_tokens = (200, 500)

    @task
    def job(self) -> None:
        self._chat()
