"""Tenant isolation and honest accounting (issue 62): the prefix cache, the charge and what is
learned belong to their tenant. Units first, then the real stack (nginx + ngx_lua, Redis, two
sidecars, the emulated vLLM node) driven as a client would."""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_sync
from aiohttp.test_utils import TestClient, TestServer

from admission.policy import parse_policy
from admission.policy.diff import describe
from admission.reload import edge_table
from admission.scheduling.answer_lengths import FLOOR, MIN_ANSWERS, AnswerLengths
from admission.scheduling.queue import FairQueue, Item
from admission.scheduling.ticket import make_ticket, new_request_id
from admission.store import keys
from admission.trust import Access
from admission.usage import release_args, release_finish
from devstack.probes import metric_sums, refunded
from devstack.stack import DEFAULT_POLICY, Stack
from tests.conftest import BASE_POLICY, make_policy, started

SECRET = b"s" * 32


def test_salts_are_per_tenant_or_per_group_and_never_the_tenant_id() -> None:
    shared = BASE_POLICY.replace("    weight: 1\n", "    weight: 1\n    cache_group: org\n")
    shared = shared.replace("    weight: 5\n", "    weight: 5\n    cache_group: org\n")
    alone = parse_policy(BASE_POLICY.replace("REDIS_URL", "redis://x"))
    grouped = parse_policy(shared.replace("REDIS_URL", "redis://x"))
    t1: Any = edge_table(alone, secret=SECRET)["tenants"]
    t2: Any = edge_table(grouped, secret=SECRET)["tenants"]
    assert t1["acme"]["salt"] != t1["small"]["salt"]  # each tenant its own cache
    assert t2["acme"]["salt"] == t2["small"]["salt"]  # one group: one cache
    assert t1["acme"]["salt"] not in (t2["acme"]["salt"],) and "acme" not in t1["acme"]["salt"]
    other: Any = edge_table(alone, secret=b"t" * 32)["tenants"]
    assert other["acme"]["salt"] != t1["acme"]["salt"]  # derived from the secret
    no_secret: Any = edge_table(alone)["tenants"]
    assert "salt" not in no_secret["acme"]  # the edge then salts each request alone
    # check --diff says what a change shares.
    lines = describe(alone, grouped)
    assert "tenant small: shares its prefix cache in group org with acme" in lines
    assert any("prefix cache its own again" in x for x in describe(grouped, alone))


def test_fail_open_sends_the_classes_cold_band() -> None:
    table: Any = edge_table(parse_policy(BASE_POLICY.replace("REDIS_URL", "redis://x")))
    assert table["engine_priority"] == {"realtime": 1, "batch": 3, "offline": 5}


def test_cut_answers_teach_no_length_and_a_booking_keeps_a_floor_of_its_cap() -> None:
    o = AnswerLengths()
    for i in range(120):  # max_tokens: 1, cut at the cap
        o.admitted(f"cut{i}", True, "m", "realtime", "mallory")
        o.answered(f"cut{i}", 1, None, "length")
    assert o.answer_kv("m", "realtime", "mallory", 1500) == 1500  # still its cap
    assert o.mean == pytest.approx(1)  # the decode guard counts what was decoded, cut or not
    for i in range(MIN_ANSWERS):  # stop strings: answers ended on purpose at 1 token
        o.admitted(f"s{i}", True, "m", "realtime", "mallory")
        o.answered(f"s{i}", 1, None, "stop")
    assert o.answer_kv("m", "realtime", "mallory", 1500) == math.ceil(1500 * FLOOR)
    o.admitted("none", True, "m", "realtime", "mallory")
    o.answered("none", 5, None, None)  # the edge did not say how it ended: nothing learned
    assert len(o._windows[("m", "realtime", "mallory")].lengths) == MIN_ANSWERS


def test_one_tenant_moves_the_decode_guard_at_most_by_its_weights_share() -> None:
    weights = {"platinum": 5.0, "free": 1.0}
    o = AnswerLengths(lambda t: weights.get(t, 1.0))
    for i in range(40):
        o.admitted(f"p{i}", True, "m", "realtime", "platinum")
        o.answered(f"p{i}", 60, None, "stop")
    before = o.mean
    for i in range(40):  # the free tier's long answers
        o.admitted(f"f{i}", True, "m", "realtime", "free")
        o.answered(f"f{i}", 400, None, "stop")
    share = 1 / 6
    assert before == pytest.approx(60)
    assert o.mean - before <= share * (400 - 60) + 1e-6  # one EWMA over all moved it to ~330


def test_long_request_tokens_judges_the_cap_not_the_learned_booking() -> None:
    text = BASE_POLICY.replace("redis:", "queue: {long_request_tokens: 1000}\nredis:")
    policy = make_policy("redis://x", text)
    q = FairQueue(policy)
    item = Item(tenant="acme", cls="realtime", cost=200, model="m", enqueued_at=0, deadline_at=9)
    item.asked = 2000  # prompt + max_tokens: long, though its tenant's answers are learned short
    q.push(item)
    assert item.cls == "batch"


def test_releases_tolerate_unknown_fields_and_carry_how_the_answer_ended() -> None:
    policy = make_policy("redis://x")
    ticket = make_ticket(new_request_id(), "n1", "acme")
    body = {"ticket": ticket, "status": 200, "usage": None, "finish": "length", "new": 1}
    assert release_args(body, policy).ticket == ticket
    assert release_finish(body) == "length" and release_finish({"finish": 3}) is None


async def test_exposed_admin_port_reads_need_the_token(redis: Any, redis_server: Any) -> None:
    from admission.metrics import Metrics
    from admission.reload import PolicyHolder
    from admission.server import build_app

    policy = make_policy(redis_server.url)
    holder = PolicyHolder(DEFAULT_POLICY, policy, Metrics())
    token = "t" * 24
    app = build_app(holder, access=Access(admin_token=token, exposed=True, edge_over_tcp=True))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        for path in ("/metrics", "/nodes", "/status.json"):
            assert (await client.get(path)).status == 401, path
            auth = {"Authorization": f"Bearer {token}"}
            assert (await client.get(path, headers=auth)).status == 200, path
        assert (await client.get("/healthz")).status in (200, 503)  # open: load balancers
        assert (await client.get("/status")).status == 200  # the page holds no figures
    finally:
        await client.close()


# -- the real stack -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from started(tmp_path_factory, "isolation", nodes=2)


def post(stack: Stack, key: str, body: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    req = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.load(r)
        return out


def cached(answer: dict[str, Any]) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def chat(system: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": "llama-3-8b",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **kw,
    }


def test_another_tenants_head_is_never_reported_cached(stack: Stack) -> None:
    """Tenant B sends a fresh 4 KiB system prompt; tenant A sends it back as a guess (also with
    B's own cache_salt, had it guessed that): never cached for A, while B's second copy is."""
    for i in range(3):
        guessed = f"globex confidential {i} " + "x" * 4096
        forged_too = f"globex secret {i} " + "z" * 4096
        post(stack, "sk-demo-globex", chat(guessed))
        post(stack, "sk-demo-globex", chat(forged_too, cache_salt="mine"))
        started = time.monotonic()
        guess = post(stack, "sk-demo-acme", chat(guessed))
        guess_s = time.monotonic() - started
        forged = post(stack, "sk-demo-acme", chat(forged_too, cache_salt="mine"))
        started = time.monotonic()
        again = post(stack, "sk-demo-globex", chat(guessed))
        again_s = time.monotonic() - started
        assert cached(guess) == 0 and cached(forged) == 0, (guess["usage"], forged["usage"])
        assert cached(again) >= 512, again["usage"]  # the owner's own head is still cached
        assert guess_s > again_s  # and the guess was not answered as fast as a hit


def test_engine_distinct_copies_of_a_head_are_never_booked_as_one(stack: Stack) -> None:
    """12 copies of a 4 KiB head that differ only where the engine renders ahead of it
    (documents, functions, an extra key of a content part): the engine computes each, and the
    sidecars book none of them as cached (one fingerprint for all 12 booked 11 as hits)."""
    head = "a shared head " + "y" * 4096
    variants: list[dict[str, Any]] = []
    for i in range(4):
        variants.append(chat(head, documents=[{"title": f"doc {i}", "text": "t"}]))
        variants.append(chat(head, functions=[{"name": f"f{i}", "parameters": {}}]))
        body = chat(head)
        body["messages"][0]["content"] = [{"a": i, "type": "text", "text": head}]
        variants.append(body)
    before = prefix_figures(stack)
    answers = [post(stack, "sk-demo-etl", v) for v in variants]
    assert [cached(a) for a in answers] == [0] * 12  # the emulator keys them apart, as vLLM
    after = prefix_figures(stack)
    assert after[0] - before[0] == 0, (before, after)  # none booked as a hit


def prefix_figures(stack: Stack) -> tuple[float, float]:
    """(booked as cached, engine cached) prompt tokens over every sidecar."""
    booked, found = metric_sums(
        stack.sock_dir,
        "admission_prefix_predicted_tokens_total ",
        "admission_prefix_engine_cached_tokens_total ",
    )
    return booked, found


def leases_left(stack: Stack) -> int:
    r = redis_sync.Redis.from_url(stack.redis_url)
    try:
        return sum(int(r.zcard(k)) for k in r.scan_iter(keys.node_leases("*")))
    finally:
        r.close()


def abort_after(stack: Stack, body: dict[str, Any], key: str, after_s: float) -> None:
    """Send a request on a raw socket and close it after `after_s`, mid-generation."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(head + data)
        time.sleep(after_s)


@pytest.mark.parametrize("stream", [False, True])
def test_an_aborted_request_is_charged_streamed_or_not(stack: Stack, stream: bool) -> None:
    """The engine prefilled and decoded until the client left: the tenant is charged what was
    booked, not refunded — a non-streamed answer's status line never came before the abort."""
    deadline = time.monotonic() + 20
    while leases_left(stack) and time.monotonic() < deadline:
        time.sleep(0.1)  # the tests before ended: their refunds are in
    before = refunded(stack.sock_dir, "globex")
    body = chat("abort me", max_tokens=3000, stream=stream)
    abort_after(stack, body, "sk-demo-globex", 1.5)
    deadline = time.monotonic() + 20
    while leases_left(stack) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leases_left(stack) == 0  # released (the engine aborted it when the relay left)
    time.sleep(0.5)  # the settle follows the lease's release in the same round trip
    assert refunded(stack.sock_dir, "globex") == before  # charged as booked: nothing refunded
