"""Prefix-aware booking (lease.lua / unlease.lua with prefix blocks) and the sidecar's prefix
index (scheduling/prefixes.py), against a real Redis.

Properties: a shared prefix is booked once per node (reference counted while leases hold it);
reference counts are never negative and equal the live leases holding each block; reserved KV
is the leases' own KV plus each held block once; everything is cleared at release and at
expiry; two sidecars see one view; pending prefill counts only the blocks not resident.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission.policy import Node
from admission.scheduling import leases, routing
from admission.scheduling.ask import Ask, Request
from admission.scheduling.prefixes import NO_PREFIX, Prefix, PrefixIndex, parse
from admission.scheduling.views import NodeView
from admission.store import Scripts, keys
from devstack.procs import RedisServer

NODE = Node(id="n1", url="http://127.0.0.1:1", models=("m",), max_inflight=64)
SIZE = 128  # tokens per block


def ticket(i: int) -> str:
    return f"{i:016x}:n1:t"


def chain(name: str, n: int) -> tuple[str, ...]:
    """n block hashes of a prefix family `name` (a prefix of another of the same name)."""
    return tuple(f"{abs(hash((name, i))) % 16**16:016x}" for i in range(n))


SHARED = chain("system", 6)  # a system prompt of 6 blocks; requests extend it
FAMILIES = [SHARED[:2], SHARED[:4], SHARED, chain("other", 3), ()]


async def fields(redis: Any) -> dict[str, str]:
    h = await redis.hgetall(keys.node_ledger("n1"))
    return {k.decode(): v.decode() for k, v in h.items()}


def ask(prompt: int, kv: int, blocks: tuple[str, ...], **kw: Any) -> Ask:
    return Ask(prompt, kv, prefix=Prefix(blocks, SIZE) if blocks else NO_PREFIX, **kw)


ops = st.lists(
    st.tuples(
        st.sampled_from(["take", "give", "drop", "undo"]),
        st.integers(0, 9),
        st.integers(0, 1),
        st.integers(0, len(FAMILIES) - 1),
        st.integers(0, 300),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
def test_shared_blocks_are_booked_once_counted_exactly_and_cleared(
    redis_server: RedisServer, ops: list[tuple[str, int, int, int, int]]
) -> None:
    import redis.asyncio as aioredis

    async def run() -> None:
        clients = [aioredis.Redis.from_url(redis_server.url) for _ in range(2)]
        await clients[0].flushall()
        scripts = [Scripts(c) for c in clients]
        live: dict[str, tuple[tuple[str, ...], int]] = {}  # ticket → (blocks, own KV)
        # Released without a lease found: a booking that comes after its request's release
        # (reply timed out, run later) books nothing (unlease.lua leaves the mark).
        gone: set[str] = set()
        try:
            for op, i, who, fam, extra in ops:
                t = ticket(i)
                if op == "take":
                    blocks = FAMILIES[fam]
                    prompt = len(blocks) * SIZE + extra + 1
                    kv = prompt + 50
                    res = (
                        await scripts[who].run(leases.take(NODE, t, 60, ask(prompt, kv, blocks)))
                    )[0]
                    assert leases.granted(res)
                    if t in gone:
                        assert leases.over(res) == "released"
                    else:
                        live[t] = (blocks, kv - len(blocks) * SIZE)
                elif op == "give":  # the request's release: it ran
                    await scripts[who].run(leases.give_back(t, released=True))
                    if live.pop(t, None) is None:
                        gone.add(t)
                else:  # given back without having run: refused after its grant, or an undo
                    final = op == "drop"
                    await scripts[who].run(leases.give_back(t, final=final))
                    live.pop(t, None)
                    if final:
                        gone.add(t)
                h = await fields(clients[1 - who])  # the other sidecar's view
                refs = {k[2:]: int(v) for k, v in h.items() if k.startswith("h:")}
                want: dict[str, int] = {}
                for blocks, _own in live.values():
                    for b in blocks:
                        want[b] = want.get(b, 0) + 1
                assert refs == want  # never negative, never a block nobody holds
                if want:  # every held block is resident (one a lease that never ran brought
                    # leaves only when nobody holds it)
                    seen = await clients[who].zmscore(keys.node_prefixes("n1"), list(want))
                    assert None not in seen
                own = sum(o for _b, o in live.values())
                assert int(h.get("kv", 0)) == own + SIZE * len(want)  # each held block once
                assert int(h.get("s", 0)) == SIZE * len(want)  # ... and known as shared
                assert {k[2:] for k in h if k.startswith("b:")} == {
                    t for t, (b, _o) in live.items() if b
                }
            for t in list(live):
                await scripts[0].run(leases.give_back(t, released=True))
            h = await fields(clients[0])
            assert int(h.get("kv", 0)) == 0
            assert not [k for k in h if k[:2] in ("h:", "b:", "k:")]
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(run())


async def test_pending_prefill_counts_only_what_the_node_has_not_computed(redis: Any) -> None:
    s = Scripts(redis)
    a = ask(1000, 1100, SHARED, prefill_rate=20_000.0)  # 6 blocks × 128 = 768 of 1,000 tokens
    res = (await s.run(leases.take(NODE, ticket(1), 60, a)))[0]
    assert leases.hit_blocks(res) == 0
    first = float((await fields(redis))["p"])
    assert 900 < first <= 1000  # all of it (less what drained meanwhile)
    await asyncio.sleep(0.1)  # its prefill (0.05 s at 20,000 tokens/s) has cleared
    first = float((await fields(redis))["p"])
    res = (await s.run(leases.take(NODE, ticket(2), 60, a)))[0]
    assert leases.hit_blocks(res) == 6
    assert float((await fields(redis))["p"]) - first <= 1000 - 768 + 1
    h = await fields(redis)
    assert int(h["kv"]) == 2 * (1100 - 768) + 768  # the prefix once
    # Released, the blocks stay resident (the engine keeps them) but cost no KV.
    await s.run(
        leases.give_back(ticket(1), released=True), leases.give_back(ticket(2), released=True)
    )
    assert int((await fields(redis))["kv"]) == 0
    assert await redis.zcard(keys.node_prefixes("n1")) == 6
    res = (await s.run(leases.take(NODE, ticket(3), 60, a)))[0]
    assert leases.hit_blocks(res) == 6  # a third request finds them computed


async def test_blocks_a_lease_brought_leave_the_node_when_its_request_never_ran(
    redis: Any,
) -> None:
    """A lease given back before its request ran (its tenant's limits said no after the lease
    rode along, it was refused or timed out, it was only an undo, or the edge could not reach
    the node): the blocks it brought were
    never computed, and a later request must not be booked a hit the engine does not have.
    Blocks resident before it, or another lease's, stay."""
    s = Scripts(redis)
    head = ask(1000, 1100, SHARED[:4], prefill_rate=20_000.0)
    await s.run(leases.take(NODE, ticket(1), 60, head))
    await asyncio.sleep(0.1)  # its prefill has cleared
    await s.run(leases.give_back(ticket(1), released=True))  # it ran: 4 blocks computed
    longer = ask(1000, 1100, SHARED, prefill_rate=20_000.0)  # the same head and 2 more blocks
    for i, undo in (
        (2, leases.give_back(ticket(2), final=True)),
        (3, leases.give_back(ticket(3))),
        (7, leases.give_back(ticket(7), released=True, ran=False)),  # its node unreachable
    ):
        res = (await s.run(leases.take(NODE, ticket(i), 60, longer)))[0]
        assert leases.hit_blocks(res) == 4
        await asyncio.sleep(0.1)  # when it would have been computed, had it run
        await s.run(undo)
        assert await redis.zcard(keys.node_prefixes("n1")) == 4  # the 2 it brought: gone
    # Held by another lease too, a block it brought stays when it goes: the other computes it.
    await s.run(leases.take(NODE, ticket(4), 60, longer), leases.take(NODE, ticket(5), 60, longer))
    await s.run(leases.give_back(ticket(4), final=True))
    assert await redis.zcard(keys.node_prefixes("n1")) == 6
    await s.run(leases.give_back(ticket(5), released=True))
    res = (await s.run(leases.take(NODE, ticket(6), 60, longer)))[0]
    assert leases.hit_blocks(res) == 6
    await s.run(leases.give_back(ticket(6), released=True))
    assert int((await fields(redis))["kv"]) == 0


async def test_a_prefix_still_being_computed_is_shared_while_its_holder_computes_it(
    redis: Any,
) -> None:
    """vLLM V1 caches a block when it schedules its chunk, and a request queued behind the one
    computing a head starts once the head's last chunk is scheduled: it shares the whole head
    (tests/test_vllm.py::test_the_same_new_prompt_sent_at_once_is_computed_once_on_both_engines).
    So a request arriving while another still prefills the same head books neither its prefill
    nor its KV again."""
    s = Scripts(redis)
    slow = ask(1000, 1100, SHARED, prefill_rate=100.0)  # 10 s of prefill booked
    await s.run(leases.take(NODE, ticket(1), 60, slow))
    p1 = float((await fields(redis))["p"])
    res = (await s.run(leases.take(NODE, ticket(2), 60, slow)))[0]
    assert leases.hit_blocks(res) == 6
    h = await fields(redis)
    assert float(h["p"]) - p1 <= 1000 - 768 + 1  # only its own tail to prefill
    assert int(h["kv"]) == 1100 + (1100 - 768)  # the head once
    assert int(h["k:" + ticket(2)]) == 1100 - 768
    # The head's scores still say when it will be computed: held, not computed.
    scores = await redis.zrange(keys.node_prefixes("n1"), 0, -1, withscores=True)
    assert len(scores) == 6 and min(sc for _b, sc in scores) > 0
    await s.run(
        leases.give_back(ticket(1), released=True), leases.give_back(ticket(2), released=True)
    )
    assert int((await fields(redis))["kv"]) == 0


async def test_a_lease_that_expires_lets_its_blocks_go(redis: Any) -> None:
    s = Scripts(redis)
    await s.run(leases.take(NODE, ticket(1), 0.05, ask(900, 1000, SHARED)))
    await asyncio.sleep(0.1)
    await s.run(leases.take(NODE, ticket(2), 60, ask(10, 50, ())))
    h = await fields(redis)
    assert int(h["kv"]) == 50 and not [k for k in h if k[:2] in ("h:", "b:")]


async def test_the_kv_limit_sees_only_blocks_not_yet_held(redis: Any) -> None:
    """Nodes no longer look full from prefixes booked per request: with 1,000 tokens of room,
    three requests of a 768-token shared prefix + 200 own fit, where booked whole only one did."""
    s = Scripts(redis)
    for i in range(3):
        a = ask(868, 968, SHARED, kv_limit=1500)
        res = (await s.run(leases.take(NODE, ticket(i), 60, a)))[0]
        assert leases.granted(res), res
    assert int((await fields(redis))["kv"]) == 768 + 3 * 200
    res = (await s.run(leases.take(NODE, ticket(9), 60, ask(900, 1000, (), kv_limit=1500))))[0]
    assert leases.refusal(res) is not None  # an unshared one does not


async def test_the_urgent_class_does_not_count_shared_blocks_as_preemptible(redis: Any) -> None:
    """vLLM preempts lower classes for realtime, but a prefix block a lower-class request holds
    stays while anyone uses it: the urgent class's KV check counts shared blocks as its own."""
    s = Scripts(redis)
    await s.run(leases.take(NODE, ticket(1), 60, ask(868, 968, SHARED)))  # batch: 768 shared
    urgent = ask(400, 500, (), kv_limit=1000, urgent=True)
    res = (await s.run(leases.take(NODE, ticket(2), 60, urgent)))[0]
    assert leases.refusal(res) is not None  # 768 shared + 500 > 1,000
    small = ask(100, 200, (), kv_limit=1000, urgent=True)
    assert leases.granted((await s.run(leases.take(NODE, ticket(3), 60, small)))[0])


async def test_resident_blocks_nobody_holds_are_evicted_least_recently_used_first(
    redis: Any,
) -> None:
    s = Scripts(redis)
    other = chain("other", 3)
    await s.run(leases.take(NODE, ticket(1), 60, ask(900, 1000, SHARED, pool_blocks=8)))
    await s.run(leases.give_back(ticket(1), released=True))  # SHARED resident, unheld
    await s.run(leases.take(NODE, ticket(2), 60, ask(500, 600, other, pool_blocks=8)))
    resident = {m.decode() for m in await redis.zrange(keys.node_prefixes("n1"), 0, -1)}
    # The pool (8 blocks) less what the lease holds as its own (600 - 3 x 128 = 216 tokens: 2
    # blocks) keeps 6: held blocks are never evicted; the unheld ones went, the tail first (the
    # least shared part), the head stays.
    assert len(resident) == 6 and set(other) <= resident
    assert set(SHARED[:3]) <= resident and set(SHARED[3:]).isdisjoint(resident)


def test_prefix_index_matches_leading_blocks_and_forgets_by_lru() -> None:
    idx = PrefixIndex()
    p6 = Prefix(SHARED, SIZE)
    idx.learn("a", Prefix(SHARED[:4], SIZE), 1.0)
    idx.learn("b", p6, 2.0)
    assert idx.matches(p6) == {"a": 4, "b": 6}
    assert idx.matches(Prefix(chain("other", 2), SIZE)) == {}
    idx.learn("a", Prefix(chain("other", 3), SIZE), 3.0, cap_blocks=5)  # 2 oldest out of "a"
    assert idx.blocks("a") == 5
    assert idx.matches(p6) == {"b": 6}  # "a" lost its first blocks, so none lead any more
    assert idx.learn("b", p6, 4.0) == 0  # nothing new: the feed is not told again
    assert idx.learn("b", Prefix(chain("other", 3), SIZE), 4.0) == 3
    idx.drop_node("b")
    assert idx.matches(p6) == {} and idx.blocks("b") == 0


def test_parse_refuses_malformed_fingerprints() -> None:
    assert parse(None, None, 4.0) == NO_PREFIX
    assert parse(list(SHARED), 512, 4.0) == Prefix(SHARED, 128)
    for bad, chars in [
        ("abc", 512),
        (["xyz"], 512),
        ([SHARED[0]], 0),
        ([SHARED[0]] * 65, 512),
        ([SHARED[0].upper()], 512),
        ([SHARED[0]], True),
    ]:
        try:
            parse(bad, chars, 4.0)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}, {chars!r}")


def test_routing_keeps_a_prompt_on_its_prefix_until_that_node_says_no(policy: Any) -> None:
    """A node holding at least HOLDS_SHARE of the prompt gets it over a sooner node holding less,
    as long as it takes it (sent elsewhere, the prefix is recomputed and copied: on the
    llm-d-like mix at 2.0× 2 runs of 11 fell to 53 / 81 % realtime in time): a hot prefix
    spreads only once its holder's booked prefill is past the class's budget. A holder of less
    than that share has no preference: the soonest first token wins."""
    from dataclasses import replace

    from admission.nodes.state import Status

    model = next(iter(policy.models()))
    n1 = next(n for n in policy.nodes.values() if model in n.models)
    nodes = [n1, replace(n1, id="n2")]
    views = [NodeView(n, state=Status.OPEN, prefill_rate=10_000.0) for n in nodes]
    cached, idle = views
    prefix = Prefix(SHARED, SIZE)  # 6 blocks: 768 tokens of a 1,000-token prompt
    cls = next(iter(policy.classes))  # realtime: a 1 s target, 10,000 tokens of budget here

    def first(blocks: int = 6) -> str:
        hits = {cached.node.id: blocks}
        ok = routing.eligible(
            views,
            policy,
            Request(model, cls, 1000, 1100, prefix=prefix),
            routing.ClusterFacts(0.0, hits=hits),
        )
        return ok[0][0].node.id

    cached.inflight = 3  # pending prefill is that of requests in flight
    cached.pending, cached.pending_at = 500.0, 0.0  # 0.05 s of backlog < 0.077 s saved
    assert first() == cached.node.id
    cached.pending = 5000.0  # 0.5 s: the idle node is sooner, the holder still within budget
    assert first() == cached.node.id
    assert first(blocks=2) == idle.node.id  # 256 of 1,000 tokens: under HOLDS_SHARE
    cached.pending = 9900.0  # + the 232 tokens it lacks of this prompt: past the budget
    assert first() == idle.node.id


def test_a_crowded_node_loses_its_prefix_preference(policy: Any) -> None:
    """Bounded load: a node holding the prompt's head keeps it only while it runs at most
    LOAD_FACTOR × the fewest requests in flight among the nodes that would take it, plus
    LOAD_SLACK; past that it ranks as if it held nothing, and the least loaded node gets the
    request (support mix, before: a tenant's chat piled onto the nodes holding its system
    prompt — 130 in flight, TPOT 200 ms — beside nodes with 30)."""
    from dataclasses import replace

    from admission.nodes.state import Status

    model = next(iter(policy.models()))
    n1 = next(n for n in policy.nodes.values() if model in n.models)
    nodes = [replace(n1, id="holder", max_inflight=256), replace(n1, id="other", max_inflight=256)]
    views = [NodeView(n, state=Status.OPEN, prefill_rate=10_000.0) for n in nodes]
    holder, other = views
    prefix = Prefix(SHARED, SIZE)
    hits = {holder.node.id: 6}
    for cls in policy.classes:

        def first(cls: str = cls) -> str:
            ok = routing.eligible(
                views,
                policy,
                Request(model, cls, 1000, 1100, prefix=prefix),
                routing.ClusterFacts(0.0, hits=hits),
            )
            return ok[0][0].node.id

        other.inflight, other.memory = 40, 0.5
        holder.memory = 0.6  # the crowded node holds more KV
        holder.inflight = int(routing.LOAD_FACTOR * 40 + routing.LOAD_SLACK)  # at the bound
        assert first() == holder.node.id, cls
        holder.inflight += 1  # past it
        assert first() == other.node.id, cls
        other.inflight, other.memory = 0, 0.45
        holder.inflight = routing.LOAD_SLACK  # a quiet cluster: the cache wins
        assert first() == holder.node.id, cls
