"""The benchmark report's arithmetic on synthetic inputs with known answers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.benchmark import repeat, report
from loadtest.benchmark.report import Record, SystemResult
from loadtest.workloads.mix import prompt_text, schedule


def rec(
    cls: str = "realtime",
    status: int = 200,
    ttft: float | None = 0.1,
    code: str = "",
    tenant: str = "a",
    tokens: int = 10,
    sent: float = 0.0,
) -> Record:
    return Record(
        "s",
        "chat",
        tenant,
        cls,
        sent,
        status,
        code,
        ttft,
        (ttft or 0) + 1 if status == 200 else None,
        tokens,
    )


def test_percentile_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert report.percentile(xs, 50) == 50
    assert report.percentile(xs, 99) == 99
    assert report.percentile(xs, 100) == 100
    assert report.percentile([7.0], 99) == 7
    assert math.isnan(report.percentile([], 50))


def test_attainment_counts_refusals_as_misses() -> None:
    rs = [
        rec(ttft=0.5),
        rec(ttft=0.9),
        rec(ttft=1.5),
        rec(status=429, ttft=None, code="requests_per_s"),
    ]
    assert report.attainment(rs, 1.0) == 0.5


def test_shares_against_weights() -> None:
    got = report.shares({"a": 500, "b": 300, "c": 200, "x": 999}, {"a": 5, "b": 3, "c": 1})
    assert got["a"] == (0.5, pytest.approx(5 / 9))
    assert got["c"][0] == pytest.approx(0.2)


def test_fair_shares_give_a_tenant_what_it_asked_for_or_its_weight_of_the_rest() -> None:
    """Weighted max-min: tenants asking less than their weight's share are owed only that."""
    got = report.fair_shares(60, {"a": 10, "b": 10, "c": 100}, {"a": 5, "b": 3, "c": 1})
    assert got == {"a": pytest.approx(1 / 6), "b": pytest.approx(1 / 6), "c": pytest.approx(2 / 3)}
    # Every tenant asking for more than it can get: the weights themselves.
    got = report.fair_shares(90, {"a": 100, "b": 100, "c": 100}, {"a": 5, "b": 3, "c": 1})
    assert got == {"a": pytest.approx(5 / 9), "b": pytest.approx(3 / 9), "c": pytest.approx(1 / 9)}
    # A tenant that sent nothing is owed nothing; the others split by their weights.
    got = report.fair_shares(40, {"a": 100, "c": 100}, {"a": 5, "b": 3, "c": 1})
    assert got == {"a": pytest.approx(5 / 6), "b": 0.0, "c": pytest.approx(1 / 6)}


@given(
    st.dictionaries(
        st.sampled_from("abcde"), st.tuples(st.floats(0, 1e6), st.integers(1, 10)), min_size=1
    ),
    st.floats(0.01, 1.0),
)
def test_fair_shares_sum_to_one_and_never_pass_what_was_asked(
    tenants: dict[str, tuple[float, int]], part: float
) -> None:
    demand = {t: d for t, (d, _w) in tenants.items()}
    weights = {t: float(w) for t, (_d, w) in tenants.items()}
    served = part * sum(demand.values())
    if served < 1e-3:
        return  # nothing served: no shares
    got = report.fair_shares(served, demand, weights)
    assert sum(got.values()) == pytest.approx(1.0)
    for t, share in got.items():
        assert share * served <= demand[t] * (1 + 1e-9) + 1e-6
        # Short of what it asked, a tenant has at least its weight's share among the others
        # short of theirs (no one short is below another short tenant's share per weight).
        if share * served < demand[t] * (1 - 1e-9) - 1e-6:
            for u, other in got.items():
                assert share / weights[t] >= other / weights[u] - 1e-9


def test_lost_requests_are_only_unexplained_failures() -> None:
    assert rec(status=0, ttft=None).lost  # no answer / reset
    assert rec(status=502, ttft=None).lost  # a 5xx the policy did not produce
    assert not rec(status=503, ttft=None, code="queue_timeout").lost
    assert not rec(status=429, ttft=None, code="queue_full").lost
    assert not rec().lost


def test_summary_and_markdown(tmp_path: Path) -> None:
    rs = [
        rec(tenant="a", tokens=50),
        rec(tenant="b", tokens=30),
        rec(tenant="b", tokens=20, ttft=2.0),
        rec(cls="batch", ttft=3.0, tokens=100),
        rec(status=503, ttft=None, code="queue_timeout"),
        rec(status=0, ttft=None),
    ]
    res = SystemResult("admission", 10.0, rs, {"n1": {"peak_memory": 0.81, "preemptions": 2}})
    s = report.summarise(res, {"realtime": 1.0, "batch": 10.0}, {"a": 1, "b": 1})
    rt = s["classes"]["realtime"]
    assert rt["sent"] == 5 and rt["ok"] == 3 and rt["lost"] == 1
    assert rt["slo_attainment"] == pytest.approx(2 / 5)
    assert rt["refused"] == {"queue_timeout": 1}
    assert s["throughput_tokens_per_s"] == pytest.approx(20.0)  # 200 tokens answered in 10 s
    assert s["goodput_tokens_per_s"] == pytest.approx(18.0)  # the 20 tokens of a late TTFT excluded
    assert s["good_tokens"] == 180
    assert s["realtime_shares"]["a"]["served"] == pytest.approx(0.5)
    table = report.markdown([s])
    assert "| admission | realtime | 5 | 40.0% (≤1000 ms; – from 5 s)" in table
    assert "81.0%" in table
    assert "| admission | 18 | 180 | 10.0 | 20 |" in table  # goodput, good tokens, makespan
    report.write_json(tmp_path / "r.json", [s], [res])
    assert (tmp_path / "r.json").read_text().startswith("{")
    paths = report.plots(tmp_path, [res], [s])
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)


def test_the_warm_figure_counts_only_requests_sent_after_the_cold_start() -> None:
    """Late first tokens in the first seconds (empty caches, unknown rates) count in the
    headline but not in the figure from WARM_S; a refusal after it counts there as a miss."""
    rs = [rec(ttft=3.0, sent=s) for s in (0.1, 1.0, 4.9)]  # the cold start: all late
    rs += [rec(sent=5.0), rec(sent=30.0), rec(sent=59.0)]
    rs += [rec(status=429, ttft=None, code="slo_unreachable", sent=40.0)]
    res = SystemResult("admission", 60.0, rs)
    rt = report.summarise(res, {"realtime": 1.0}, {"a": 1})["classes"]["realtime"]
    assert rt["slo_attainment"] == pytest.approx(3 / 7)
    assert rt["slo_attainment_warm"] == pytest.approx(3 / 4)
    assert "| 42.9% (≤1000 ms; 75.0% from 5 s) |" in report.markdown(
        [report.summarise(res, {"realtime": 1.0}, {"a": 1})]
    )


def test_prompt_cached_per_class_counts_answers_whose_engine_reported_it() -> None:
    told = [rec(), rec(), rec(cls="batch")]
    for r, (prompt, cached) in zip(told, [(100, 60), (300, 0), (200, 200)], strict=True):
        r.prompt_tokens, r.cached_tokens = prompt, cached
    silent = rec()  # an engine that did not report cached tokens: left out, not counted as 0
    silent.prompt_tokens = 1000
    refused = rec(status=429, ttft=None, code="over_fair_share")
    refused.prompt_tokens, refused.cached_tokens = 500, 500  # not answered: not counted
    res = SystemResult("s", 10.0, [*told, silent, refused])
    classes = report.summarise(res, {"realtime": 1.0}, {"a": 1})["classes"]
    assert classes["realtime"]["prefix_hits"] == pytest.approx(60 / 400)
    assert classes["batch"]["prefix_hits"] == pytest.approx(1.0)
    none = report.summarise(SystemResult("s", 10.0, [rec()]), {}, {"a": 1})
    assert none["classes"]["realtime"]["prefix_hits"] is None
    assert "| – |" in report.markdown([none])


def test_prompt_cached_after_an_answered_turn_leaves_out_turns_after_a_refused_one() -> None:
    # A conversation's turns 1..4 (sent in that order, listed out of order): turn 2 is refused,
    # so turn 3 finds only turn 1 cached; turns 1, 2 (refused: not counted) and 4 (after an
    # answered turn 3) count. Another conversation's first turn counts too.
    def turn(conv: str, at: float, prompt: int, cached: int, status: int = 200) -> Record:
        r = rec(status=status, ttft=0.1 if status == 200 else None)
        r.sent_s, r.conversation, r.prompt_tokens, r.cached_tokens = at, conv, prompt, cached
        return r

    rs = [
        turn("c", 3.0, 300, 100),  # after the refused turn 2
        turn("c", 1.0, 100, 20),
        turn("c", 2.0, 200, 0, status=429),
        turn("c", 4.0, 400, 300),
        turn("d", 1.5, 100, 50),
    ]
    rt = report.summarise(SystemResult("s", 10.0, rs), {"realtime": 1.0}, {"a": 1})["classes"]
    assert rt["realtime"]["prefix_hits"] == pytest.approx(470 / 900)
    assert rt["realtime"]["prefix_hits_followed"] == pytest.approx(370 / 600)
    plain = report.summarise(SystemResult("s", 10.0, [rec()]), {}, {"a": 1})["classes"]
    assert plain["realtime"]["prefix_hits_followed"] is None  # no conversations: not shown


def test_the_busiest_spell_of_conversation_turns_is_counted_and_shown() -> None:
    # Turns wait for answers: what a system is sent per second is its own. The busiest 10 s
    # holds the turns sent at 20.0–29.9 s (4), not the spread-out ones before; a class without
    # conversations (open-loop arrivals: the schedule's for every system) shows none.
    def turn(at: float) -> Record:
        r = rec()
        r.sent_s, r.conversation = at, "c"
        return r

    rs = [turn(t) for t in (0.0, 9.0, 18.0, 20.0, 25.0, 29.0, 29.9, 30.0)]
    summary = report.summarise(SystemResult("s", 40.0, rs), {"realtime": 1.0}, {"a": 1})
    assert summary["classes"]["realtime"]["sent_busiest"] == 4
    assert report.busiest(rs, 5.0) == 3  # 25.0, 29.0, 29.9
    assert "| s | realtime | 8 (4 in 10 s) |" in report.markdown([summary])
    plain = report.summarise(SystemResult("s", 10.0, [rec()]), {}, {"a": 1})
    assert plain["classes"]["realtime"]["sent_busiest"] is None
    assert "| s | realtime | 1 |" in report.markdown([plain])


def test_schedule_is_seeded_poisson() -> None:
    a, b = schedule(20, 30, seed=3), schedule(20, 30, seed=3)
    assert a == b
    assert 500 < len(a) < 700  # 600 expected
    kinds = {r.kind for r in a}
    assert kinds == {"chat", "summarise", "offline"}
    assert len(prompt_text(250)) // 4 == 250


def test_e2e_target_is_scored_and_counts_in_goodput() -> None:
    slow = rec(tenant="a", tokens=40)
    slow.e2e_s = 12.0  # TTFT fine, whole answer past the 10 s end-to-end target
    fast = rec(tenant="b", tokens=60)
    fast.e2e_s = 2.0
    res = SystemResult("admission", 10.0, [slow, fast], {})
    s = report.summarise(res, {"realtime": 1.0}, {"a": 1, "b": 1}, {"realtime": 10.0})
    assert s["classes"]["realtime"]["e2e_attainment"] == pytest.approx(0.5)
    assert s["goodput_tokens_per_s"] == pytest.approx(6.0)  # only the answer within both targets
    assert "| 50.0% |" in report.markdown([s])


def test_prompts_do_not_share_a_prefix_and_keep_their_size() -> None:
    a, b = prompt_text(300, 1), prompt_text(300, 2)
    assert a[:8] != b[:8] and len(a) == len(b) == 1200


def test_tpot_target_is_scored_over_every_request_sent() -> None:
    steady = rec(tenant="a", tokens=101)
    steady.e2e_s = (steady.ttft_s or 0) + 100 * 0.05  # 50 ms per token after the first
    slow = rec(tenant="b", tokens=101)
    slow.e2e_s = (slow.ttft_s or 0) + 100 * 0.08  # 80 ms
    refused = Record("admission", "chat", "a", "realtime", 0.0, 429, "queue_full")
    res = SystemResult("admission", 10.0, [steady, slow, refused], {})
    s = report.summarise(res, {"realtime": 1.0}, {"a": 1, "b": 1}, None, {"realtime": 0.06})
    c = s["classes"]["realtime"]
    assert c["tpot_attainment"] == pytest.approx(1 / 3)
    assert c["tpot_p50_ms"] == pytest.approx(50.0)  # nearest rank of 50 and 80 ms
    assert steady.tpot_s == pytest.approx(0.05) and refused.tpot_s is None
    assert "| – / 33.3% |" in report.markdown([s])


def test_shares_are_compared_with_weights_only_for_backlogged_tenants() -> None:
    """A tenant that got every realtime request answered took what it asked for: its share of
    served tokens says nothing about fairness, and the table says so instead of comparing."""
    served_all = [rec(tenant="a", tokens=50), rec(tenant="b", tokens=10)]
    res = SystemResult("fifo", 10.0, served_all, {})
    s = report.summarise(res, {"realtime": 1.0}, {"a": 5, "b": 1})
    assert not s["realtime_shares"]["a"]["backlogged"]
    assert "no tenant backlogged" in report.markdown([s])
    refused_b = [*served_all, rec(tenant="b", status=429, ttft=None, code="requests_per_s")]
    s = report.summarise(
        SystemResult("fifo", 10.0, refused_b, {}), {"realtime": 1.0}, {"a": 5, "b": 1}
    )
    table = report.markdown([s])
    # b asked for more (its refused request's tokens) than it got: backlogged, its fair share is
    # what is left after a's 50 tokens (a asked for no more than it got).
    assert "a all answered" in table and "b 17% vs 17% / 17% (17%)" in table


def test_a_refused_request_counts_what_it_asked_for_in_its_tenants_fair_share() -> None:
    """The 5-weight tenant asked for 10 tokens and got them; the 1-weight one asked for 150 and
    got 50: the weights (83 / 17 %) are not what is owed — a's 10 tokens are, b the rest."""
    refused = rec(tenant="b", status=429, ttft=None, code="slo_unreachable", tokens=0)
    refused.asked_tokens = 100
    rs = [rec(tenant="a", tokens=10), rec(tenant="b", tokens=50), refused]
    s = report.summarise(SystemResult("x", 10.0, rs, {}), {"realtime": 1.0}, {"a": 5, "b": 1})
    assert s["realtime_shares"]["b"]["fair"] == pytest.approx(50 / 60)
    assert s["realtime_shares"]["b"]["weight"] == pytest.approx(1 / 6)
    assert "b 83% vs 83% / 83% (17%)" in report.markdown([s])


def test_the_windowed_fair_share_does_not_owe_a_tenant_capacity_used_before_any_backlog() -> None:
    """First 10 s: a and b each ask 100 tokens and get them (nobody backlogged: each owed what it
    asked). Later: each asks 100, 60 are served, 5 : 1 — a owed 50, b 10. Over the whole run
    at once a (weight 5) would be owed 5/6 of the 260 served, as if the first window's capacity
    could have waited for its later requests; window by window it is owed 150 of 260."""

    def r(tenant: str, at: float, tokens: int, ok: bool = True) -> Record:
        out = rec(tenant=tenant, tokens=tokens if ok else 0)
        out.sent_s, out.asked_tokens = at, tokens
        if not ok:
            out.status, out.ttft_s, out.code = 429, None, "over_fair_share"
        return out

    rs = [r("a", 1, 100), r("b", 2, 100)]
    rs += [r("a", 11, 50), r("a", 12, 50, ok=False), r("b", 13, 10), r("b", 14, 90, ok=False)]
    s = report.summarise(SystemResult("x", 20.0, rs, {}), {"realtime": 1.0}, {"a": 5, "b": 1})
    a = s["realtime_shares"]["a"]
    assert a["served"] == pytest.approx(150 / 260)
    assert a["fair"] == pytest.approx(200 / 260)  # the whole run: a's asks, 200, all owed
    assert a["fair_windowed"] == pytest.approx(150 / 260)
    assert "a 58% vs 77% / 58% (83%)" in report.markdown([s])


def _summary(system: str, goodput: float, realtime: float, hits: float | None) -> dict[str, Any]:
    return {
        "system": system,
        "goodput_tokens_per_s": goodput,
        "good_tokens": int(goodput * 60),
        "prefix_hit_ratio": hits,
        "classes": {"realtime": {"slo_attainment": realtime}, "offline": {"slo_attainment": None}},
    }


def test_repeated_rounds_give_median_spread_and_paired_differences() -> None:
    rounds = [
        [_summary("admission", 1000, 0.90, 0.5), _summary("vllm_router", 900, 0.95, 0.6)],
        [_summary("vllm_router", 800, 0.80, 0.6), _summary("admission", 1100, 0.70, 0.4)],
        [_summary("admission", 900, 0.99, 0.5), _summary("vllm_router", 950, 0.90, 0.7)],
    ]
    out = repeat.table(rounds)
    first = out.split("Paired")[0]
    rows = {ln.split(" | ")[0].strip("| "): ln for ln in first.splitlines() if ln.startswith("| ")}
    # Medians with the range, over the three rounds.
    assert "1000 (900–1100)" in rows["admission"] and "90.0% (70.0%–99.0%)" in rows["admission"]
    assert "60,000 (54,000–66,000)" in rows["admission"]  # good tokens
    assert "900 (800–950)" in rows["vllm_router"] and "60.0% (60.0%–70.0%)" in rows["vllm_router"]
    # Paired, round by round: goodput +100, +300, −50 (2 of 3 won); realtime −5, −10, +9 points.
    against = out.split("Paired")[1]
    assert "+100 (-50–+300), 2/3" in against
    assert "-5.0 (-10.0–+9.0), 1/3" in against
    # A class without a TTFT target has no column.
    assert "offline" not in out


def test_rounds_rotate_the_systems() -> None:
    systems = ["fifo", "vllm_router", "admission"]
    assert repeat.order(systems, 0) == systems
    assert repeat.order(systems, 1) == ["vllm_router", "admission", "fifo"]
    assert repeat.order(systems, 3) == systems
