"""Prefix-aware admission through the sidecar's HTTP API: the edge's fingerprint is validated,
booked once per node, and a tenant pays `cached_token_price` for what the engine found cached."""

from __future__ import annotations

import itertools
from typing import Any

from admission.policy import load_policy
from admission.scheduling.priority import band, engine_priority
from admission.store import keys
from devstack.stack import DEFAULT_POLICY
from tests.test_server import admit_body, sidecar  # noqa: F401  (the fixture)

BLOCKS = [f"{i:016x}" for i in range(1, 9)]  # 8 blocks × 512 characters = 1,024 tokens


async def test_a_malformed_fingerprint_is_refused_and_nothing_is_booked(
    sidecar: Any,  # noqa: F811
    redis: Any,
) -> None:
    client, _h, _p = sidecar
    for prefix, chars in [("abc", 512), (["NOT-HEX"], 512), (BLOCKS, 0), (BLOCKS * 9, 512)]:
        r = await client.post("/admit", json=admit_body(prefix=prefix, prefix_chars=chars))
        assert r.status == 400, prefix
        assert "prefix" in (await r.json())["error"]["message"]
    assert await redis.zcard(keys.node_leases("n1")) == 0


async def test_requests_sharing_a_head_book_it_once(sidecar: Any, redis: Any) -> None:  # noqa: F811
    client, _h, _p = sidecar
    tickets = []
    for _ in range(2):
        body = admit_body(prompt_tokens=1100, max_tokens=100, prefix=BLOCKS, prefix_chars=512)
        r = await client.post("/admit", json=body)
        assert r.status == 200
        tickets.append((await r.json())["ticket"])
    ledger = await redis.hgetall(keys.node_ledger("n1"))
    assert int(ledger[b"kv"]) == 1024 + 2 * (1200 - 1024)  # the head once, each its own rest
    # The engine reports what it found cached (the first request computed the head, the second
    # found it): the status page shows it beside what was booked as cached.
    assert (await (await client.get("/status.json")).json())["prefix"][
        "booked_cached_tokens"
    ] is None
    for t, cached in zip(tickets, (0, 1024), strict=True):
        usage = {
            "prompt_tokens": 1100,
            "completion_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await client.post("/release", json={"ticket": t, "status": 200, "usage": usage})
    assert int((await redis.hgetall(keys.node_ledger("n1")))[b"kv"]) == 0
    prefix = (await (await client.get("/status.json")).json())["prefix"]
    assert prefix == {
        "booked_cached_tokens": 1024,
        "engine_cached_tokens": 1024,
        "engine_prompt_ratio": None,  # these releases carry no estimate of the edge's
    }


async def test_cached_prompt_tokens_cost_the_tenants_price(sidecar: Any, redis: Any) -> None:  # noqa: F811
    client, holder, path = sidecar
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 50,
        "prompt_tokens_details": {"cached_tokens": 800},
    }

    async def refund() -> int:
        r = await client.post("/admit", json=admit_body(prompt_tokens=1000, max_tokens=100))
        ticket = (await r.json())["ticket"]
        r = await client.post("/release", json={"ticket": ticket, "status": 200, "usage": usage})
        return int((await r.json())["refunded_tokens"])

    assert await refund() == 1100 - 1050  # the default price: a cached token costs the same
    path.write_text(
        path.read_text().replace(
            "token_burst: 5000}", "token_burst: 5000, cached_token_price: 0.1}", 1
        )
    )
    assert holder.reload()
    assert holder.current.tenants["acme"].limits.cached_token_price == 0.1
    assert await refund() == 1100 - (1050 - 720)  # 800 cached tokens at 0.1: 720 less
    bad = {**usage, "prompt_tokens_details": {"cached_tokens": 2000}}  # more than the prompt
    r = await client.post("/admit", json=admit_body())
    ticket = (await r.json())["ticket"]
    r = await client.post("/release", json={"ticket": ticket, "status": 200, "usage": bad})
    assert r.status == 200 and (await r.json())["refunded_tokens"] == 0  # unreadable: as booked


async def test_the_engine_starts_a_cached_prompt_before_a_cold_one_of_its_class(
    sidecar: Any,  # noqa: F811
) -> None:
    """vLLM orders its waiting queue by (priority, arrival): the priority sent for a prompt whose
    head the node holds is lower (earlier) than for the same prompt cold; prompts with nothing
    cached keep arrival order whatever their lengths; every class goes before the next."""
    client, _h, _p = sidecar

    async def priority(**kw: Any) -> int:
        r = await client.post("/admit", json=admit_body(**kw))
        adm = await r.json()
        assert r.status == 200, adm
        await client.post("/release", json={"ticket": adm["ticket"], "status": 200})
        return int(adm["priority"])

    head = {"prefix": BLOCKS, "prefix_chars": 512}
    cold = await priority(prompt_tokens=1100, max_tokens=10, **head)
    held = await priority(prompt_tokens=1100, max_tokens=10, **head)  # the node holds the head
    assert held < cold
    short = await priority(prompt_tokens=20, max_tokens=10)
    long = await priority(prompt_tokens=1500, max_tokens=10)
    assert short == long == cold  # nothing cached: arrival order, whatever the length
    batch = await priority(prompt_tokens=1100, max_tokens=10, **{"class": "batch"}, **head)
    assert max(cold, held) < batch  # the bucket's burst is 5,000 tokens: this is its last


def test_bands_split_a_class_by_what_the_node_holds_and_keep_classes_apart() -> None:
    assert [band(1000, n) for n in (0, 250, 251, 1000)] == [0, 0, 1, 1]
    assert band(0, 0) == 1  # nothing to hold
    # On the shipped policy, a cold prompt of each class goes before a held one of the next.
    p = load_policy(DEFAULT_POLICY)
    node = next(iter(p.nodes.values()))
    order = sorted(p.classes, key=lambda c: p.classes[c].priority)
    for urgent, after in itertools.pairwise(order):
        cold = engine_priority(p, urgent, urgent, "acme", node, 9000, 9000)
        held = engine_priority(p, after, after, "acme", node, 9000, 0)
        assert cold < held, (urgent, after)


async def test_a_head_the_engine_does_not_confirm_stops_being_booked_as_held(
    sidecar: Any,  # noqa: F811
    redis: Any,
) -> None:
    """A copy booked as holding the head is released with `cached_tokens` 0 (the engine keys it
    apart: a fingerprint that is not its cache key): the head leaves the node's resident set
    and this sidecar's index, and the next copy books its prefill again. Kept as held, every
    later copy was booked as a hit the engine never had (issue 62, finding 2)."""
    client, _h, _p = sidecar
    body = admit_body(prompt_tokens=1100, max_tokens=100, prefix=BLOCKS, prefix_chars=512)

    async def admit_and_release(cached: int) -> str:
        ticket = (await (await client.post("/admit", json=body)).json())["ticket"]
        usage = {
            "prompt_tokens": 1100,
            "completion_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        r = await client.post("/release", json={"ticket": ticket, "status": 200, "usage": usage})
        assert r.status == 200
        return str(ticket)

    async def booked_cached() -> int:
        return int(
            (await (await client.get("/status.json")).json())["prefix"]["booked_cached_tokens"] or 0
        )

    await admit_and_release(0)  # computed it: booked as computing, nothing predicted
    assert await booked_cached() == 0
    assert await redis.zcard(keys.node_prefixes("n1")) == len(BLOCKS)  # resident now
    await admit_and_release(0)  # booked as a hit; the engine found nothing
    assert await booked_cached() == 1024
    assert await redis.zcard(keys.node_prefixes("n1")) == 0  # no longer believed held
    await admit_and_release(1024)  # booked as computing it again: nothing predicted
    assert await booked_cached() == 1024
