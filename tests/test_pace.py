"""The batch worker's lines in flight follow the cluster: more while lines run at the speed of an
idle cluster, fewer when they start waiting, half at once on a refusal."""

from __future__ import annotations

from admission.batch.pace import Pace


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def feed(p: Pace, clock: Clock, per_token: float, n: int, tokens: int = 64) -> None:
    for _ in range(n):
        clock.t += 0.1
        p.sample(per_token * tokens, tokens, 200)


def test_grows_to_the_ceiling_while_lines_run_at_base_speed() -> None:
    clock = Clock()
    p = Pace(16, clock=clock)
    assert p.allowed() == 2
    feed(p, clock, 0.02, 400)
    assert p.allowed() == 16


def test_backs_off_when_lines_start_waiting_and_recovers_when_they_do_not() -> None:
    clock = Clock()
    p = Pace(16, start=12, clock=clock)
    feed(p, clock, 0.02, 5)  # the base: what an idle cluster gives
    before = p.allowed()
    feed(p, clock, 0.05, 200)  # 2.5× slower: most of our lines are waiting
    assert p.allowed() < before / 2
    assert p.allowed() >= 1
    low = p.allowed()
    feed(p, clock, 0.02, 300)  # realtime went quiet again
    assert p.allowed() > low


def test_refusals_halve_at_most_once_a_second_and_never_below_the_floor() -> None:
    clock = Clock()
    p = Pace(16, start=16, clock=clock)
    for _ in range(5):  # a burst of 429s within one second: one cut
        p.sample(0.01, 0, 429)
    assert p.allowed() == 8
    for _ in range(10):
        clock.t += 1.0
        p.sample(0.01, 0, 503)
    assert p.allowed() == 1


def test_answers_without_usage_or_other_errors_do_not_move_it() -> None:
    clock = Clock()
    p = Pace(16, start=4, clock=clock)
    p.sample(1.0, 0, 200)
    p.sample(1.0, 10, 400)
    assert p.allowed() == 4


def test_the_base_is_forgotten_after_two_windows() -> None:
    clock = Clock()
    p = Pace(16, start=8, base_window_s=10, clock=clock)
    feed(p, clock, 0.01, 5)
    clock.t += 25  # within a window or two the old base ages out: the slower speed is the new base
    feed(p, clock, 0.03, 600)
    assert p.allowed() == 16
