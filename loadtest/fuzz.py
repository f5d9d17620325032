"""Fuzzing: request bodies and headers through the real edge, mutated policies through the loader.

Edge: hypothesis draws requests (bodies valid or nearly so, arbitrary JSON, raw bytes; spoofed
internal headers; good, bad, huge and random API keys) and sends them, `--batch` at a time,
through a real stack (NGINX + ngx_lua, two sidecars, Redis, two emulated nodes). Each answer
must be defined: 200, or an OpenAI-shaped JSON error, and a 5xx only with a documented code.
Afterwards: no traceback in any sidecar log, no Lua error in NGINX's, no API key in any log,
every sidecar healthy, nothing left booked in Redis.

Policy: hypothesis mutates the shipped policies.yaml (lines deleted, duplicated, re-indented,
values replaced, bytes inserted, invalid UTF-8, truncation); `load_policy` must return a policy
or raise PolicyError, whose messages never carry a key.

    python -m loadtest.fuzz --edge-cases 100000 --policy-cases 100000 --batch-api-cases 10000

The Batch API (fuzz_batch.py) and cross-tenant probes with aborts (fuzz_isolation.py) go through
the same edge. Short runs of each are part of the test suite (tests/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from hypothesis import given
from hypothesis import strategies as st

from loadtest.fuzzers import drawn
from loadtest.fuzzers.checks import Case, Tally, check
from loadtest.fuzzers.estimate import report_estimate
from loadtest.fuzzers.isolation import report_isolation
from loadtest.fuzzers.policy import report_policy

# Every random API key the fuzzer sends carries this mark, so that the logs can be searched for
# any of them afterwards.
SECRET_MARK = "sk-fuzzsecret-"
FUZZ_KEY = "sk-fuzz-tenant-0123456789"
DEMO_KEYS = ("sk-demo-acme", "sk-demo-etl", "sk-demo-hobbyist")
FUZZ_TENANT = {
    "fuzz": {
        "keys": [f"plain:{FUZZ_KEY}"],
        "classes": ["realtime", "batch"],
        "limits": {
            "requests_per_s": 100000,
            "request_burst": 100000,
            "tokens_per_min": 10**8,
            "token_burst": 400,
            "max_concurrent": 512,
            "max_queued": 5000,
        },
    }
}


# -- strategies ------------------------------------------------------------------------------
def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any], tenths: int = 8) -> Any:
    """`good` in `tenths` of ten draws, else `bad`: most cases get past the first check."""
    return st.integers(0, 9).flatmap(lambda i: good if i < tenths else bad)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=10,
)
small_int = st.integers(-3, 300) | st.sampled_from([0, 1, 2**31, 2**53 + 1, 10**7, 10**7 + 1])
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio"]) | values},
    optional={"text": st.text(max_size=80) | values, "image_url": values},
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | values},
    optional={
        "content": st.text(max_size=200) | st.lists(part, max_size=3) | values,
        "name": st.text(max_size=10),
    },
)
FIELDS = {
    "model": mostly(st.just("llama-3-8b"), st.sampled_from(["nope", ""]) | values, 9),
    "messages": mostly(st.lists(message, min_size=1, max_size=3), values),
    "prompt": st.text(max_size=300)
    | st.lists(st.text(max_size=40), max_size=4)
    | st.lists(st.integers(-5, 70000), max_size=40)
    | st.lists(st.lists(st.integers(0, 1000), max_size=8), max_size=3)
    | values,
    "max_tokens": small_int | values,
    "max_completion_tokens": small_int | values,
    "n": small_int | values,
    "best_of": small_int | values,
    "stream": st.booleans() | values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | values}) | values,
    "priority": small_int | values,
    "temperature": st.floats(-1, 3) | values,
    "ignore_eos": st.booleans() | values,
    "min_tokens": small_int | values,
    "tools": st.lists(values, max_size=2),
}
bodies = st.fixed_dictionaries({"model": FIELDS.pop("model")}, optional=FIELDS).flatmap(
    lambda b: st.dictionaries(st.text(max_size=10), values, max_size=2).map(lambda x: {**x, **b})
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
auth = mostly(
    st.sampled_from([f"Bearer {FUZZ_KEY}"] * 6 + [f"Bearer {k}" for k in DEMO_KEYS]),
    st.one_of(
        st.builds(lambda s: f"Bearer {SECRET_MARK}{s}", header_text),
        st.builds(lambda s: f"bearer {SECRET_MARK}{s}", st.text("abc", max_size=600)),
        st.sampled_from(["", "Bearer ", "Basic Zm9vOmJhcg==", "Bearer  " + FUZZ_KEY]),
        st.none(),
    ),
)
spoofed = st.dictionaries(
    st.sampled_from(
        [
            "X-Admission-Class",
            "X-Admission-Ticket",
            "X-Tenant-Id",
            "X-Tenant",
            "x-admission-priority",
            "X-Request-Class",
            "X-Admission-Node",
        ]
    ),
    header_text,
    max_size=3,
)


def _raw(b: dict[str, Any], how: int, junk: bytes) -> bytes:
    text = json.dumps(b).encode()
    if how == 0:
        return text
    if how == 1:
        return text[: max(1, len(text) // 2)]  # truncated JSON
    if how == 2:
        return junk  # arbitrary bytes (invalid UTF-8 among them)
    if how == 3:
        return json.dumps(b.get("messages", [])).encode()  # JSON, not an object
    return text + b" " + junk[:8]  # trailing garbage


cases = st.builds(
    lambda path, b, how, junk, a, extra: Case(
        path, _raw(b, how, junk), {**({"Authorization": a} if a is not None else {}), **extra}
    ),
    st.sampled_from(["/v1/chat/completions"] * 3 + ["/v1/completions"] * 2 + ["/v1/models"]),
    bodies,
    st.sampled_from([0] * 6 + [1, 2, 3, 4]),
    st.binary(max_size=200),
    auth,
    spoofed,
)


# -- the edge --------------------------------------------------------------------------------
async def send(s: aiohttp.ClientSession, url: str, case: Case, tally: Tally) -> None:
    headers = {"Content-Type": "application/json", **case.headers}
    if SECRET_MARK in headers.get("Authorization", ""):
        tally.secrets_sent.add(headers["Authorization"][7:])
    t0 = time.monotonic()
    try:
        if case.path == "/v1/models":
            req = s.get(url + case.path, headers=headers)
        else:
            req = s.post(url + case.path, data=case.raw, headers=headers)
        async with req as r:
            body = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.statuses[0] += 1
        tally.failures.append(f"no answer ({type(exc).__name__}: {exc}) for {case.raw[:120]!r}")
        return
    code, failure = check(case, status, body)
    tally.answered(status, time.monotonic() - t0, repr(case.raw[:200]), code, failure)


def fuzz_edge(url: str, n_cases: int, batch: int = 32, seed: int | None = None) -> Tally:
    """Send `n_cases` hypothesis-drawn requests through the edge at `url`, `batch` in flight.

    Hypothesis draws one case per example (a whole batch per example overruns its buffer and
    degenerates to empty bodies) and hands it to a client loop in another thread, which keeps
    up to `batch` requests in flight. Failures are collected with the input that caused them,
    not raised: the run goes on to the end."""
    tally = Tally()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    session = asyncio.run_coroutine_threadsafe(_session(), loop).result()
    slots = threading.Semaphore(batch)

    async def one(case: Case) -> None:
        try:
            await send(session, url, case, tally)
        finally:
            slots.release()

    @drawn.cases(n_cases, seed)
    @given(cases)
    def run(case: Case) -> None:
        slots.acquire()
        asyncio.run_coroutine_threadsafe(one(case), loop)

    try:
        run()
        for _ in range(batch):  # every request answered
            slots.acquire()
    finally:
        asyncio.run_coroutine_threadsafe(session.close(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    return tally


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), connector=aiohttp.TCPConnector(limit=64)
    )


# -- the command -----------------------------------------------------------------------------
def run_edge(
    n_cases: int,
    batch: int,
    work: Path,
    report: Callable[[str], None],
    batch_cases: int = 0,
    isolation_cases: int = 0,
) -> list[str]:
    from devstack.stack import DEFAULT_POLICY, Stack

    stack = Stack(
        DEFAULT_POLICY, work, nodes=2, sidecars=2, policy_overrides={"tenants": FUZZ_TENANT}
    )
    failures: list[str] = []
    try:
        stack.start()
        t0 = time.monotonic()
        tally = fuzz_edge(stack.url, n_cases, batch)
        secs = time.monotonic() - t0
        report(
            f"edge: {tally.cases:,} cases in {secs:.0f} s ({tally.cases / secs:,.0f}/s); "
            f"statuses {dict(sorted(tally.statuses.items()))}"
        )
        report(f"edge: slowest answer {tally.slowest[0]:.2f} s: {tally.slowest[1][:160]}")
        report("edge: codes " + ", ".join(f"{k} ×{v}" for k, v in tally.codes.most_common(12)))
        failures += tally.failures
        if batch_cases:
            from loadtest.fuzzers.batch import fuzz_batch

            t0 = time.monotonic()
            bt = Tally()
            fuzz_batch(stack.url, batch_cases, bt)
            report(
                f"batch API: {bt.cases:,} operations in {time.monotonic() - t0:.0f} s; "
                f"statuses {dict(sorted(bt.statuses.items()))}"
            )
            report(
                "batch API: codes " + ", ".join(f"{k} ×{v}" for k, v in bt.codes.most_common(12))
            )
            failures += bt.failures
        failures += report_isolation(stack, isolation_cases, report) if isolation_cases else []
        failures += _after(stack, tally.secrets_sent)
    finally:
        stack.stop()
    return failures


def _after(stack: Any, secrets_sent: set[str]) -> list[str]:
    """Health, leftovers and logs once the traffic stopped."""
    from devstack.probes import log_findings, sidecar_health, wait_unbooked

    problems = []
    health = sidecar_health(stack.sock_dir)
    if len(health) != 2 or any(h != (200, "ok") for h in health):
        problems.append(f"sidecars unhealthy: {health}")
    if left := wait_unbooked(stack.redis_url):
        problems.append(f"left booked in Redis: {sorted(left)[:5]}")
    problems += log_findings(stack.run_dir, {FUZZ_KEY, *DEMO_KEYS, *secrets_sent})
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--edge-cases", type=int, default=10000)
    p.add_argument("--policy-cases", type=int, default=10000)
    p.add_argument(
        "--batch-api-cases",
        type=int,
        default=2000,
        help="Batch API operations (files, batches) through the same edge",
    )
    p.add_argument("--estimate-cases", type=int, default=0, help="prompt estimate vs tokenizer")
    p.add_argument("--isolation-cases", type=int, default=0, help="fuzz_isolation.py's cases")
    p.add_argument("--batch", type=int, default=32, help="edge requests in flight together")
    p.add_argument("--work", default=None, help="run directory (default: a temporary one)")
    a = p.parse_args(argv)
    failures = report_policy(a.policy_cases) if a.policy_cases else []
    if a.estimate_cases:
        failures += report_estimate(a.estimate_cases)
    if a.edge_cases:
        work = Path(a.work or tempfile.mkdtemp(prefix="fuzz-"))
        say = lambda s: print(s, flush=True)  # noqa: E731
        failures += run_edge(a.edge_cases, a.batch, work, say, a.batch_api_cases, a.isolation_cases)
    for f in failures[:30]:
        print("FAIL", f)
    print(
        f"{len(failures)} failures" + (f" (first 30 shown; logs in {a.work})" if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
