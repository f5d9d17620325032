"""What a request books for its answer: what its tenant's answers of the class run to, not the
client's max_tokens cap — and the emulator and load generator that let the benchmark show it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.scheduling.answer_lengths import ANSWERS, MIN_ANSWERS, AnswerLengths
from admission.store import keys
from devstack.procs import RedisServer
from engine.api import build_app
from engine.emulator import Engine
from engine.openai_api import ANSWER_MARK
from engine.profiles import PROFILES
from loadtest.workloads.mix import load_kinds, schedule
from tests.test_dispatcher import make
from tests.test_limiter import tenant_policy
from tests.test_server import admit_body, set_node


def answer(o: AnswerLengths, ticket: str, n: int, tenant: str = "acme") -> None:
    o.admitted(ticket, True, "m", "realtime", tenant)
    o.answered(ticket, n)


def test_a_request_books_what_its_tenants_answers_run_to_never_more_than_its_cap() -> None:
    o = AnswerLengths()
    assert o.answer_kv("m", "realtime", "acme", 1024) == 1024  # nothing known: the cap
    for i in range(MIN_ANSWERS - 1):
        answer(o, f"a{i}", 100 + i)
    assert o.answer_kv("m", "realtime", "acme", 1024) == 1024  # too few answers yet
    answer(o, "last", 150)
    high = o.answer_kv("m", "realtime", "acme", 1024)
    assert 100 + MIN_ANSWERS - 2 <= high <= 150  # the longest answers, not the cap
    assert o.answer_kv("m", "realtime", "acme", 60) == 60  # never above the request's cap
    # Another tenant, class or model books its own cap until its own answers are known.
    assert o.answer_kv("m", "realtime", "globex", 1024) == 1024
    assert o.answer_kv("m", "batch", "acme", 1024) == 1024
    assert o.answer_kv("other", "realtime", "acme", 1024) == 1024
    # A release without usage, or of a request admitted elsewhere, teaches nothing.
    o.admitted("nousage", True, "m", "realtime", "globex")
    o.answered("nousage", -1)
    o.answered("elsewhere", 5)
    assert o.answer_kv("m", "realtime", "globex", 1024) == 1024
    # Answers that run to their cap again are booked whole again, within the window.
    for i in range(ANSWERS):
        answer(o, f"long{i}", 1024)
    assert o.answer_kv("m", "realtime", "acme", 1024) == 1024
    # The urgent class's mean (the decode guard's) is still learned from the same releases.
    assert o.mean > 500


def test_a_release_of_a_request_admitted_elsewhere_teaches_by_the_names_it_carries() -> None:
    # The edge spreads releases over the sidecars: one admitted by another sidecar names its
    # model and class (the tenant is in the ticket), and this one learns from it as from its own.
    o = AnswerLengths()
    named = (True, ("m", "realtime", "acme"))
    for i in range(MIN_ANSWERS - 1):
        o.answered(f"b{i}", 100 + i, named)
    assert o.answer_kv("m", "realtime", "acme", 1024) == 1024  # too few yet: the cap
    assert o.booked_answers() == [
        {"model": "m", "class": "realtime", "tenant": "acme", "tokens": None, "answers": 19}
    ]
    o.answered("last", 150, named)
    assert 100 <= o.answer_kv("m", "realtime", "acme", 1024) <= 150
    assert o.mean > 100  # the urgent class's answers: the decode guard's mean too
    # A request this sidecar admitted is learned under its own key, whatever the release names.
    o.admitted("mine", False, "m", "batch", "globex")
    o.answered("mine", 7, (True, ("m", "realtime", "acme")))
    assert [a["answers"] for a in o.booked_answers()] == [1, MIN_ANSWERS]
    assert o.booked_answers()[0]["class"] == "batch"


async def test_the_ledger_books_the_learned_answer_not_the_cap(
    redis: Any, redis_server: RedisServer
) -> None:
    """Through the dispatcher and lease.lua on a real Redis: a tenant whose answers run to about
    100 tokens under a max_tokens of 1,000 books its prompt and about 100 on the node, and is
    charged as much by the fair queue; its token bucket still reserves the cap until release."""
    p = tenant_policy(redis_server.url, "{requests_per_s: 1000, tokens_per_min: 100000000}")
    d, client = make(p)
    ledger = keys.node_ledger("n1")

    async def booked(ticket: str) -> int:
        await d.ahead.settled([ticket])  # a booking answered ahead runs in the background
        return abs(int(await redis.hget(ledger, f"k:{ticket}")))

    first = await d.admit(p.tenants["t1"], "realtime", "m", 10, 1000)
    assert await booked(first.ticket) == 10 + 1000  # nothing learned yet: the cap
    await d.release(first.ticket, 10 + 90, out=90)
    for i in range(MIN_ANSWERS):
        adm = await d.admit(p.tenants["t1"], "realtime", "m", 10, 1000)
        await d.release(adm.ticket, 10 + 80 + i, out=80 + i)
    adm = await d.admit(p.tenants["t1"], "realtime", "m", 10, 1000)
    assert 10 + 90 <= await booked(adm.ticket) <= 10 + 80 + MIN_ANSWERS
    # Fairness charges the tenant the same, not its cap (a generous cap costs it no turns).
    assert d.nodes.shares._pairs[("m", "realtime")].cost["t1"] == await booked(adm.ticket)
    assert d.nodes.answers.booked_answers() == [  # /status.json's answers_booked
        {
            "model": "m",
            "class": "realtime",
            "tenant": "t1",
            "tokens": await booked(adm.ticket) - 10,
            "answers": MIN_ANSWERS + 1,
        }
    ]
    await d.release(adm.ticket, 10 + 90, out=90)
    await d.store.backlog.flush()
    assert await redis.hget(ledger, "kv") in (None, b"0")  # all given back
    await client.aclose()


async def test_the_emulator_ends_an_answer_where_the_prompt_says_before_the_cap() -> None:
    engine = Engine(PROFILES["tiny"])
    client = TestClient(TestServer(build_app(engine)))
    await client.start_server()
    try:
        for content, cap, tokens, finish in (
            ("hello " * 20 + ANSWER_MARK.format(7), 100, 7, "stop"),
            ("hello " * 20 + ANSWER_MARK.format(70), 20, 20, "length"),  # the cap ends it
            ("hello " * 20, 12, 12, "length"),  # no mark: to the cap, as before
        ):
            body = {"model": engine.model, "max_tokens": cap}
            body["messages"] = [{"role": "user", "content": content}]
            r = await client.post("/v1/chat/completions", json=body)
            doc = await r.json()
            assert r.status == 200, doc
            assert doc["usage"]["completion_tokens"] == tokens
            assert doc["choices"][0]["finish_reason"] == finish
    finally:
        await client.close()


def test_a_workload_kind_sends_its_cap_above_its_answers(tmp_path: Path) -> None:
    f = tmp_path / "mix.yaml"
    f.write_text(
        "kinds:\n"
        "  - {name: chat, class: realtime, tenants: [acme], share: 1.0,\n"
        "     prompt_tokens: [100, 200], output_tokens: [20, 40], max_tokens: 1024}\n"
    )
    reqs = schedule(10, 5, seed=1, kinds=load_kinds(str(f)))
    assert reqs and all(r.cap == 1024 and 20 <= r.max_tokens <= 40 for r in reqs)
    f.write_text(f.read_text().replace("1024", "30"))  # below the longest answer
    with pytest.raises(SystemExit, match="max_tokens is below"):
        load_kinds(str(f))
    shipped = load_kinds(str(Path(__file__).parents[1] / "loadtest/workloads/capped.yaml"))
    assert all(k.max_tokens > k.output_tokens[1] for k in shipped)


async def sidecars(
    redis: Any, redis_server: RedisServer, tmp_path: Path, n: int
) -> list[tuple[Any, TestClient[Any, Any]]]:
    """`n` sidecar apps on one Redis and node n1, started, with acme's limits lifted (many
    requests of a 4,000-token cap): (app, its HTTP client) each."""
    from admission.metrics import Metrics
    from admission.policy import load_policy
    from admission.reload import PolicyHolder
    from admission.server import build_app
    from tests.conftest import BASE_POLICY

    path = tmp_path / "policies.yaml"
    text = BASE_POLICY.replace(
        "{requests_per_s: 10, request_burst: 10, tokens_per_min: 60000, token_burst: 5000}",
        "{requests_per_s: 1000, request_burst: 1000, tokens_per_min: 10000000}",
    )
    path.write_text(text.replace("REDIS_URL", redis_server.url))
    await set_node(redis, "n1")
    out = []
    for i in range(n):
        app = build_app(
            PolicyHolder(path, load_policy(path), Metrics()), edge_table=tmp_path / f"e{i}"
        )
        client = TestClient(TestServer(app))
        await client.start_server()
        out.append((app, client))
    return out


async def test_the_edges_releases_teach_what_a_tenant_books_through_the_sidecar(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Over the sidecar's HTTP API, as the edge drives it: releases carrying the engine's usage
    teach what a batch tenant's answers run to under a max_tokens of 1,600; /status.json shows
    it, and the next admission books it on the node, not the cap."""
    from admission.server import DISPATCHER

    app, client = (await sidecars(redis, redis_server, tmp_path, 1))[0]
    body = admit_body(**{"class": "batch", "max_tokens": 1600})
    try:
        for i in range(MIN_ANSWERS):
            answer = await (await client.post("/admit", json=body)).json()
            assert "ticket" in answer, answer
            ticket = answer["ticket"]
            usage = {"prompt_tokens": 10, "completion_tokens": 100 + i}
            r = await client.post(
                "/release", json={"ticket": ticket, "status": 200, "usage": usage, "finish": "stop"}
            )
            assert r.status == 200
        doc = await (await client.get("/status.json")).json()
        want = [
            {
                "model": "m",
                "class": "batch",
                "tenant": "acme",
                "tokens": 100 + MIN_ANSWERS - 1,
                "answers": MIN_ANSWERS,
            }
        ]
        assert doc["answers_booked"] == want
        ticket = (await (await client.post("/admit", json=body)).json())["ticket"]
        await app[DISPATCHER].ahead.settled([ticket])  # a booking answered ahead: background
        booked = await redis.hget(keys.node_ledger("n1"), f"k:{ticket}")
        assert abs(int(booked)) == 10 + 100 + MIN_ANSWERS - 1
    finally:
        await client.close()


async def test_a_sidecar_learns_from_releases_of_requests_another_admitted(
    redis: Any, redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two sidecars on one Redis, over their HTTP API: requests admitted by A and released at B
    (the edge spreads releases) teach B when the release names the model and class; a release
    without them, or naming a class the policy lacks, teaches nothing; a name that is not a
    string is refused on its own entry of a batch."""
    clients = [c for _app, c in await sidecars(redis, redis_server, tmp_path, 2)]
    a, b = clients
    body = admit_body(**{"class": "batch", "max_tokens": 4000})

    async def released_at_b(entries: list[dict[str, Any]]) -> list[Any]:
        codes = []
        for e in entries:  # one at a time: the node takes a few at once
            got = await (await a.post("/admit", json=body)).json()
            assert "ticket" in got, got
            e["ticket"] = got["ticket"]
            e.setdefault("usage", {"prompt_tokens": 10, "completion_tokens": 100})
            e.setdefault("finish", "stop")
            r = await b.post("/release", json=[e])
            assert r.status == 200
            codes += [x.get("error", {}).get("code") for x in (await r.json())["results"]]
        return codes

    async def learned(client: TestClient[Any, Any]) -> list[tuple[str, str, str, int]]:
        doc = await (await client.get("/status.json")).json()
        return [(x["model"], x["class"], x["tenant"], x["answers"]) for x in doc["answers_booked"]]

    try:
        named = {"model": "m", "class": "batch"}
        assert await released_at_b([{}, {"model": "m"}, {**named, "class": "gold"}]) == [None] * 3
        assert await learned(b) == []  # not named, half named, a class the policy lacks
        codes = await released_at_b([dict(named) for _ in range(MIN_ANSWERS)] + [{"model": 5}])
        assert codes == [None] * MIN_ANSWERS + ["invalid_request"]
        refused = [
            r.getMessage() for r in caplog.records if "refused since the last" in r.getMessage()
        ]
        assert refused == [
            "1 release(s) refused since the last such line, the last (invalid_request): model"
            " must be a string of 1 to 256 characters, or null; their leases wait out their TTL"
        ]  # logged: the edge takes the batch's 200 as delivered
        assert await learned(b) == [("m", "batch", "acme", MIN_ANSWERS)]
        assert await learned(a) == []  # A admitted them; the releases went to B
    finally:
        for c in clients:
            await c.close()


def test_refused_release_entries_are_logged_once_per_interval_with_their_count(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An edge newer than its sidecars has every release refused: one line every 10 s, not one
    # per release.
    from admission import usage
    from admission.errors import BadRequest

    clock = [100.0]
    monkeypatch.setattr(usage.time, "monotonic", lambda: clock[0])
    refused = usage.RefusedReleases()
    bad = BadRequest("unknown field(s): model", code="unknown_field")
    for _ in range(3):
        refused.note(bad)
    clock[0] += usage.REFUSED_LOG_EVERY_S
    refused.note(bad)
    lines = [r.getMessage() for r in caplog.records if "refused since the last" in r.getMessage()]
    assert [line.split(" ")[0] for line in lines] == ["1", "3"]  # the first, then 2 held + 1
