"""Overload's one state per (model, class) (scheduling/overload.py): its marks, its clocks and
who reads it. Pure: time is passed in."""

from __future__ import annotations

import re

from admission.scheduling.overload import (
    CONFIRM_S,
    FULL_S,
    REFUSING_S,
    YOUNG_S,
    Overload,
    State,
)
from tests.conftest import BASE_POLICY, ROOT, make_policy


def test_a_short_run_of_full_arrivals_marks_the_class_short_briefly() -> None:
    """A host's stall queues a few arrivals for a moment: the class is short of nodes for
    YOUNG_S after the last of them. Arrivals that find no node for CONFIRM_S or longer (an
    overload) keep it so for FULL_S after the last, through short spells of free slots."""
    o = Overload()
    assert not o.short("m", "rt", 0.0)
    for t in (10.0, 10.2, 10.5):  # a stall: half a second of arrivals finding no node
        o.no_node("m", "rt", t)
    assert o.short("m", "rt", 10.5 + YOUNG_S - 0.01)
    assert not o.short("m", "rt", 10.5 + YOUNG_S + 0.01)
    marks = [20.0 + i / 5 for i in range(int(CONFIRM_S * 5) + 2)]  # an overload: past CONFIRM_S
    for t in marks:
        o.no_node("m", "rt", t)
    last = marks[-1]
    assert o.short("m", "rt", last + FULL_S - 0.01)
    assert not o.short("m", "rt", last + FULL_S + 0.01)
    o.no_node("m", "rt", 40.0)  # long after: a new run, young again
    assert not o.short("m", "rt", 40.0 + YOUNG_S + 0.01)
    # A run is one while its marks come within the window: a young run's gap of more than
    # YOUNG_S starts it again, so two stalls do not add up to a confirmed spell.
    o.no_node("m", "rt", 40.0 + YOUNG_S + 0.5)
    o.no_node("m", "rt", 40.0 + YOUNG_S + 0.5 + CONFIRM_S - 0.1)
    assert not o.short("m", "rt", 40.0 + YOUNG_S + 0.5 + CONFIRM_S - 0.1 + YOUNG_S + 0.01)


def test_the_states_follow_the_two_marks_per_model_and_class() -> None:
    o = Overload()
    assert o.state("m", "rt", 0.0) == State.WITHIN and o.snapshot(0.0) == []
    o.refused_late("m", "rt", 100.0)
    assert o.state("m", "rt", 100.0 + REFUSING_S - 0.1) == State.LATE
    assert o.late("m", "rt", 100.0) and not o.late("m", "batch", 100.0)
    assert not o.late("m", None, 100.0)
    assert o.state("other", "rt", 100.0) == State.WITHIN  # another model is not past capacity
    o.no_node("m", "rt", 101.0)
    assert o.state("m", "rt", 101.0) == State.SHEDDING
    assert o.snapshot(101.0) == [{"model": "m", "class": "rt", "state": "shedding"}]
    assert o.state("m", "rt", 100.0 + REFUSING_S) == State.WITHIN  # both marks ran out
    o.no_node("m", "rt", 200.0)
    assert o.state("m", "rt", 200.0) == State.SHORT
    assert o.state("m", "rt", 200.0 + YOUNG_S) == State.WITHIN


def test_a_lower_class_is_owed_its_min_share_only_while_an_urgent_class_is_late() -> None:
    text = BASE_POLICY.replace(
        "deadline_s: 5}", "deadline_s: 5, admit_until: drain, slo: {ttft_ms: 1000}}"
    ).replace("promote_after_s: 2}", "promote_after_s: 2, slo: {ttft_ms: 10000}}")
    p = make_policy("redis://127.0.0.1:1", text)
    o = Overload()
    assert not o.owed(p, "m", "batch", 0.0, lambda _m, _c, _t: 0.0)  # within capacity: no
    o.refused_late("m", "realtime", 0.0)
    assert o.owed(p, "m", "batch", 1.0, lambda _m, _c, _t: 0.05)  # under its min_share
    assert not o.owed(p, "m", "batch", 1.0, lambda _m, _c, _t: 0.2)  # over it
    assert not o.owed(p, "m", "offline", 1.0, lambda _m, _c, _t: 0.0)  # no SLO: the queue's order
    assert not o.owed(p, "m", "realtime", 1.0, lambda _m, _c, _t: 0.0)  # the urgent class itself
    assert not o.owed(
        p, "other", "batch", 1.0, lambda _m, _c, _t: 0.0
    )  # another model's realtime is fine


def test_the_overload_clocks_live_in_one_module() -> None:
    """`grep` for the clocks finds them in overload.py only, and only it keeps the marks."""
    clocks = re.compile(r"\b(REFUSING_S|FULL_S|CONFIRM_S|YOUNG_S)\s*=")
    marks = re.compile(r"def (refused_late|no_node|still_full|refusing)\b")
    found = {
        str(f.relative_to(ROOT))
        for f in (ROOT / "admission").rglob("*.py")
        if clocks.search(text := f.read_text()) or marks.search(text)
    }
    assert found == {"admission/scheduling/overload.py"}
