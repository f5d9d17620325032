"""Fuzzing what one tenant can learn of another's cache, and what an aborted request costs.

hypothesis draws cases against a running stack (the fuzzer's, loadtest/fuzz.py): an owner and a
prober among the demo tenants (no shared `cache_group` in the shipped policy), a fresh prompt
head of random length and shape (system prompt, content parts, completions prompt), the cache
salt a prober forges, and an aborted request (streamed or not, its client gone at a random time
once the engine has it). Each case must hold:
- the prober's copy of the owner's head is never reported cached (`cached_tokens` 0); the
  owner's own second copy is counted when found cached (it may go to another node: routing
  weighs a short head little), so that a run shows the probes could have found something;
- an aborted request refunds its tenant nothing: the engine received it, it is charged as booked.
Cases run one at a time (a refund is read from the sidecars' counters before and after).
"""

from __future__ import annotations

import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from loadtest.fuzzers import drawn

KEYS = {"acme": "sk-demo-acme", "globex": "sk-demo-globex", "etl": "sk-demo-etl"}
TENANTS = {"acme": "acme", "globex": "globex", "etl": "nightly-etl"}  # key name → tenant id
MODEL = "llama-3-8b"


def _post(url: str, key: str, body: dict[str, Any], path: str) -> dict[str, Any] | None:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out: dict[str, Any] = json.load(r)
            return out
    except urllib.error.HTTPError as e:
        with e:
            return None  # refused (a limit): the case says nothing


def _cached(answer: dict[str, Any] | None) -> int:
    if answer is None:
        return -1
    details = answer.get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _body(shape: int, head: str, salt: str | None) -> tuple[str, dict[str, Any]]:
    extra = {"cache_salt": salt} if salt else {}
    if shape == 0:
        msgs = [{"role": "system", "content": head}, {"role": "user", "content": "hi"}]
    elif shape == 1:
        msgs = [{"role": "user", "content": [{"type": "text", "text": head}]}]
    else:
        return "/v1/completions", {"model": MODEL, "prompt": head, "max_tokens": 2, **extra}
    return "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, **extra}


def _abort(url: str, key: str, stream: bool, after_s: float) -> None:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "abort " + secrets.token_hex(4)}],
            "max_tokens": 2000,
            "stream": stream,
        }
    ).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + body)
        time.sleep(after_s)


def fuzz_isolation(stack: Any, n_cases: int, seed: int | None = None) -> tuple[list[str], int]:
    """Run `n_cases` drawn cases against `stack` (a devstack Stack): the failures, described,
    and how many times the owner's own second copy was found cached."""
    from devstack.probes import refunded, wait_unbooked

    failures: list[str] = []
    own_hits = [0]
    names = sorted(KEYS)

    @drawn.cases(n_cases, seed)
    @given(
        owner=st.sampled_from(names),
        prober=st.sampled_from(names),
        blocks=st.integers(1, 6),
        shape=st.integers(0, 2),
        forged=st.sampled_from([None, "", "x", "owner"]),
        stream=st.booleans(),
        abort_s=st.floats(0.3, 1.5),
    )
    def case(
        owner: str,
        prober: str,
        blocks: int,
        shape: int,
        forged: str | None,
        stream: bool,
        abort_s: float,
    ) -> None:
        if owner == prober:
            return
        head = f"secret of {owner} {secrets.token_hex(8)} " + "q" * (600 * blocks)
        salt = owner if forged == "owner" else (forged or None)
        path, body = _body(shape, head, None)
        if _post(stack.url, KEYS[owner], body, path) is None:
            return
        path, probe = _body(shape, head, salt)
        got = _cached(_post(stack.url, KEYS[prober], probe, path))
        if got > 0:
            failures.append(f"{prober} found {got} tokens of {owner}'s head cached ({shape=})")
        own_hits[0] += _cached(_post(stack.url, KEYS[owner], body, path)) > 0
        tenant = TENANTS[prober]
        wait_unbooked(stack.redis_url)
        before = refunded(stack.sock_dir, tenant)
        _abort(stack.url, KEYS[prober], stream, abort_s)
        if left := wait_unbooked(stack.redis_url):
            failures.append(f"the aborted request's lease was left booked: {sorted(left)[:3]}")
        time.sleep(0.3)  # the settle follows the release in its round trip
        if (after := refunded(stack.sock_dir, tenant)) != before:
            failures.append(
                f"an aborted request ({stream=}, {abort_s:.2f} s) refunded {after - before}"
            )

    case()
    return failures, own_hits[0]


def report_isolation(stack: Any, n_cases: int, report: Callable[[str], None]) -> list[str]:
    """`fuzz_isolation` with a line for the fuzzer's report; the failures."""
    t0 = time.monotonic()
    failures, own = fuzz_isolation(stack, n_cases)
    secs = time.monotonic() - t0
    report(f"isolation: {n_cases:,} cases ({own} owners' own heads found) in {secs:.0f} s")
    return failures
