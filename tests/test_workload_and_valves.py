"""The benchmark's own parts an SRE relies on: a YAML workload, and the engine-only baseline's
admission valves (vLLM 0.32's --max-num-queued-tokens / -reqs) in the emulator."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml

from engine.emulator import Engine
from engine.profiles import PROFILES
from engine.scheduler import Seq
from loadtest.workloads.mix import Req, load_kinds, schedule


def test_workload_file_defines_the_mix(tmp_path: Path) -> None:
    f = tmp_path / "mix.yaml"
    f.write_text(
        "kinds:\n"
        "  - {name: rag, class: realtime, tenants: [acme], share: 1.0,\n"
        "     prompt_tokens: [3000, 3000], output_tokens: [20, 20]}\n"
    )
    kinds = load_kinds(str(f))
    reqs = schedule(10, 5, seed=1, kinds=kinds)
    assert reqs and all(r.kind == "rag" and r.prompt_tokens == 3000 for r in reqs)
    f.write_text("kinds:\n  - {name: x}\n")
    with pytest.raises(SystemExit, match="kinds\\[0\\]"):
        load_kinds(str(f))


def test_a_shared_prefix_is_what_the_engines_prefix_cache_sees(tmp_path: Path) -> None:
    from engine.scheduler import block_hashes
    from loadtest.workloads.mix import prompt_text

    f = tmp_path / "mix.yaml"
    f.write_text(
        "kinds:\n"
        "  - {name: rag, class: realtime, tenants: [acme, globex], share: 1.0,\n"
        "     prompt_tokens: [100, 400], output_tokens: [20, 20], shared_prefix_tokens: 64}\n"
    )
    reqs = schedule(10, 5, seed=1, kinds=load_kinds(str(f)))
    assert reqs and all(r.prefix_tokens == 64 for r in reqs)
    texts = {
        t: [
            prompt_text(r.prompt_tokens, int(r.at_s * 1e6), f"rag/{t}", r.prefix_tokens)
            for r in reqs
            if r.tenant == t
        ]
        for t in ("acme", "globex")
    }
    for t, ts in texts.items():
        assert all(
            len(x) == 4 * r.prompt_tokens
            for x, r in zip(ts, (q for q in reqs if q.tenant == t), strict=True)
        )
        hashes = [block_hashes(x, 16) for x in ts]
        assert len({h[:4] for h in hashes}) == 1  # 64 tokens: 4 shared blocks
        assert len({h[4] for h in hashes}) == len(ts)  # then each its own
    assert block_hashes(texts["acme"][0], 16)[0] != block_hashes(texts["globex"][0], 16)[0]


def test_shipped_workloads_load_and_use_the_bench_policys_classes_and_tenants() -> None:
    from loadtest.bench import BENCH_POLICY

    policy = yaml.safe_load(Path(BENCH_POLICY).read_text())
    files = sorted((Path(__file__).parent.parent / "loadtest" / "workloads").glob("*.yaml"))
    assert {f.stem for f in files} >= {"agents", "rag", "nightly"}
    for f in files:
        kinds = load_kinds(str(f))
        assert kinds, f
        for k in kinds:
            assert k.cls in policy["classes"], (f, k.name)
            for t in k.tenants:
                assert k.cls in policy["tenants"][t]["classes"], (f, k.name, t)


async def test_queued_tokens_valve_sheds_instead_of_queueing() -> None:
    e = Engine(PROFILES["tiny"], max_queued_tokens=1000)
    e.submit(Seq(600, 10))
    with pytest.raises(OverflowError, match="max_num_queued_tokens"):
        e.submit(Seq(600, 10))  # 1,200 prompt tokens would wait: refused
    e.submit(Seq(300, 10))
    r = Engine(PROFILES["tiny"], max_queued_reqs=1)
    r.submit(Seq(10, 10))
    with pytest.raises(OverflowError, match="max_num_queued_reqs"):
        r.submit(Seq(10, 10))


def test_bounds_follow_the_roofline_and_the_order() -> None:
    """The benchmark's header: offered compute per class, and the most of a class any order
    gives a first token in time behind the classes before it (shortest first, prefill only)."""
    from dataclasses import replace

    from loadtest.benchmark.capacity import bounds_line, demand, first_token_bound

    p = PROFILES["a100-40gb-llama3-8b"]
    per_token = p.compute_s_per_token
    # 10 s of arrivals on 2 nodes: 100 realtime requests of 900 + 100 tokens, 100 batch ones.
    reqs = [Req(i / 10, "chat", "acme", "realtime", 900, 100) for i in range(100)]
    reqs += [Req(i / 10, "doc", "etl", "batch", 2900, 100) for i in range(100)]
    got = demand(p.name, reqs, nodes=2, seconds=10)
    assert got["realtime"] == pytest.approx(100 * 1000 * per_token / 20)
    assert got["batch"] == pytest.approx(3 * got["realtime"])
    # Prefill room until 10 s + the 5 s target on 2 nodes, less realtime's prompts, in batch
    # prompts of 2,900 tokens: the bound counts whole requests.
    room = 2 * 15 - 100 * 900 * per_token
    fits = min(100, int(room // (2900 * per_token)))
    assert first_token_bound(p.name, reqs, "batch", ["realtime"], 2, 10, 5) == fits / 100
    assert first_token_bound(p.name, reqs, "batch", [], 2, 10, 5) >= fits / 100
    assert first_token_bound(p.name, reqs, "offline", ["realtime"], 2, 10, 5) == 1.0  # none sent
    # Shortest first: with room for one long or three short prompts, three of four fit.
    mixed = [Req(0, "d", "etl", "batch", n, 1) for n in (1000, 1000, 1000, 3000)]
    tight = 3000 * per_token  # 1 node, 0 s window, the target as room
    assert first_token_bound(p.name, mixed, "batch", [], 1, 0, tight) == 0.75
    # Realtime that alone needs more than the cluster: nothing of batch fits behind it.
    flood = reqs + [Req(0, "chat", "acme", "realtime", 100_000, 1) for _ in range(10)]
    assert first_token_bound(p.name, flood, "batch", ["realtime"], 2, 10, 5) == 0.0
    line = bounds_line(p.name, reqs, 2, 10, [("realtime", 1.0), ("batch", 5.0), ("offline", None)])
    assert "batch with a first token in time behind realtime: at most" in line
    assert "offline" not in line
    # Turns that wait for their answers arrive when the system lets them: no bound is claimed.
    talk = [
        replace(r, conversation=f"c{i % 10}") if r.cls == "batch" else r for i, r in enumerate(reqs)
    ]
    line = bounds_line(p.name, talk, 2, 10, [("realtime", 1.0), ("batch", 5.0)])
    assert "realtime with a first token in time behind nothing: at most" in line
    assert "batch with a first token in time behind realtime: " in line
    assert "batch with a first token in time behind realtime: at most" not in line
    assert "not a bound" in line


def test_calibration_and_bounds_count_a_cached_prefix_once() -> None:
    """A mix whose prompts share a prefix is served faster by an engine with prefix caching
    (vLLM V1's default): calibrating without it would offer such a mix far below "1.5×"."""
    from dataclasses import replace

    from loadtest.benchmark.capacity import completed_rate, computed_prompt, demand
    from loadtest.workloads.mix import Kind, Req

    r = Req(0.0, "chat", "acme", "realtime", 1000, 10, prefix_tokens=512)
    assert computed_prompt(r, 16) == 488
    assert computed_prompt(replace(r, prefix_tokens=1000), 16) == 8  # whole blocks only
    assert computed_prompt(replace(r, prompt_tokens=512), 16) == 1  # the last token computed
    got = demand("a100-40gb-llama3-8b", [r], nodes=1, seconds=1)["realtime"]
    assert got == pytest.approx(
        demand("a100-40gb-llama3-8b", [replace(r, prompt_tokens=488, prefix_tokens=0)], 1, 1)[
            "realtime"
        ]
    )
    shared = (Kind("chat", "realtime", ("acme", "globex"), 1.0, (1500, 2500), (40, 80), 1024),)
    plain = (replace(shared[0], shared_prefix_tokens=0),)
    profile = "a100-40gb-llama3-8b"
    assert completed_rate(profile, 12, 40, shared) > 1.3 * completed_rate(profile, 12, 40, plain)


def test_the_idealised_schedule_leaves_out_what_cannot_make_it() -> None:
    """loadtest.ideal: one node, three cold prompts of ~0.64 s each sent at 0, 0 and 0.5 s, a
    1 s target. Sending every one, the second is late and the third, behind it, too; leaving
    the second out, the third starts at 0.64 s and is in time. A prompt whose prefix the node
    computed is prefilled for its own part only."""
    from loadtest.ideal import first_tokens, prefill_s
    from loadtest.workloads.mix import Req

    p = PROFILES["a100-40gb-llama3-8b"]
    one = prefill_s(p, 6000)
    assert 0.6 < one < 0.7 and prefill_s(p, 2048) == pytest.approx(p.step_s(2048, 0))
    reqs = [Req(t, "chat", f"c{i}", "realtime", 6000, 10) for i, t in enumerate((0, 0, 0.5))]
    assert first_tokens(p, reqs, 1, 1.0, leave_out=False) == (pytest.approx(1 / 3), [0, 0.5])
    assert first_tokens(p, reqs, 1, 1.0, leave_out=True) == (pytest.approx(2 / 3), [0])
    assert first_tokens(p, reqs, 2, 1.0, leave_out=False)[0] == 1.0  # a node each, then 0.78 s
    # The same tenant's prefix, computed by the first: the others prefill 1,000 tokens each.
    shared = [Req(t, "chat", "acme", "realtime", 6000, 10, prefix_tokens=5000) for t in (0, 0, 0)]
    assert first_tokens(p, shared, 1, 1.0, leave_out=False)[0] == 1.0


def _conversation(seed: int = 3) -> list[Req]:
    """The turns of one conversation of the shipped conversations mix, in order (≥ 4 turns)."""
    kinds = load_kinds(str(Path(__file__).parents[1] / "loadtest/workloads/conversations.yaml"))
    reqs = schedule(20, 60, seed=seed, kinds=kinds)
    by: dict[str, list[Req]] = {}
    for r in reqs:
        if r.conversation and r.cls == "realtime":
            by.setdefault(r.conversation, []).append(r)
    return next(ts for ts in by.values() if len(ts) >= 4)


def test_a_turn_resends_the_history_as_answered_and_a_refused_turn_is_not_in_it() -> None:
    from loadtest.workloads.mix import Histories, req_prompt

    turns = _conversation()
    h = Histories()
    for t in turns:  # every turn answered: the prompts are the schedule's
        sent = h.sent(t)
        assert sent == t
        h.done(sent, answered=True)

    t1, t2, t3, t4 = turns[:4]
    h = Histories()
    s1 = h.sent(t1)
    h.done(s1, answered=True)
    s2 = h.sent(t2)
    h.done(s2, answered=False)  # refused: never history
    s3 = h.sent(t3)
    q3 = t3.prompt_tokens - t3.history_tokens - t2.max_tokens  # turn 3's own question
    assert q3 == t3.question_tokens > 0
    assert s3.prompt_tokens == t1.prompt_tokens + t1.max_tokens + q3
    assert s3.prompt_tokens < t3.prompt_tokens
    assert s3.history_tokens == t1.prompt_tokens  # what the engine may hold
    # The engine computed turn 1's prompt: turn 3 as sent begins with it.
    assert req_prompt(s3, 0).startswith(req_prompt(s1, 0))
    h.done(s3, answered=True)
    s4 = h.sent(t4)
    q4 = t4.prompt_tokens - t4.history_tokens - t3.max_tokens
    assert s4.prompt_tokens == s3.prompt_tokens + t3.max_tokens + q4
    assert s4.history_tokens == s3.prompt_tokens
    h = Histories()  # the first turn refused: the next resends the system prompt alone
    h.done(h.sent(t1), answered=False)
    assert h.sent(t2).prompt_tokens == t1.prefix_tokens + t2.question_tokens


async def test_a_conversations_next_turn_waits_for_the_last_answer() -> None:
    """The driver sends a turn only once the last one is answered (or refused), with the history
    as answered; other requests keep their schedule (open loop)."""
    from dataclasses import replace

    from aiohttp import web

    from devstack.procs import free_port
    from loadtest.benchmark.driver import drive

    seen: list[tuple[float, int, str]] = []  # (arrival, prompt characters, conversation tag)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body["messages"][0]["content"]
        tag = "c" if "<conv-0>" in text else "x"
        seen.append((time.monotonic(), len(text), tag))
        if tag == "c" and sum(1 for s in seen if s[2] == "c") == 2:
            return web.json_response({"error": {"code": "slo_unreachable"}}, status=429)
        await asyncio.sleep(1.0)
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        turns = [replace(t, conversation="conv-0") for t in _conversation()[:3]]
        turns = [replace(t, at_s=0.05 * i) for i, t in enumerate(turns)]
        other = Req(0.1, "chat", turns[0].tenant, "realtime", 50, 10)
        t0 = time.monotonic()
        res = await drive(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            [turns[0], turns[1], other, turns[2]],
            {turns[0].tenant: "k"},
            None,
            "stub",
            "m",
            [],
            None,
        )
    finally:
        await runner.cleanup()
    conv = [(at - t0, n) for at, n, tag in seen if tag == "c"]
    plain = [at - t0 for at, _n, tag in seen if tag == "x"]
    assert len(conv) == 3 and len(plain) == 1
    assert conv[1][0] >= 1.0  # turn 2 after turn 1's answer (1 s), not at 0.05 s
    assert plain[0] < 0.8  # the other request on its schedule (0.1 s)
    assert conv[2][0] - conv[1][0] < 0.8  # turn 3 right after turn 2's refusal
    t1, t2, t3 = turns
    q3 = t3.prompt_tokens - t3.history_tokens - t2.max_tokens
    assert conv[0][1] == 4 * t1.prompt_tokens and conv[1][1] == 4 * t2.prompt_tokens
    assert conv[2][1] == 4 * (t1.prompt_tokens + t1.max_tokens + q3)  # turn 2 left out
    recs = sorted((r for r in res.records if r.conversation), key=lambda r: r.sent_s)
    assert [r.status for r in recs] == [200, 429, 200]
    assert recs[1].sent_s >= 1.0  # when it was due: after the answer
