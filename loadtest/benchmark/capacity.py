"""Capacity of one emulated node for a workload, found in virtual time (no processes, seconds).

The engine core (`engine.scheduler`) runs the workload's arrivals at increasing rates; capacity
is the highest steady-state completion rate. Benchmarks calibrate with this before every
comparison, since "1.5x capacity" must mean the same thing for every system in the run. Prompts
that share a prefix (`Kind.shared_prefix_tokens`) share its blocks here as in the emulated
engine's prefix cache, so a mix that caches well is not under-calibrated.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from engine.profiles import PROFILES
from engine.scheduler import Scheduler, Seq
from loadtest.workloads.mix import MIXED, Kind, Req, schedule


def completed_rate(
    profile: str,
    rate: float,
    seconds: float,
    kinds: tuple[Kind, ...] = MIXED,
    num_blocks: int | None = None,
) -> float:
    s = Scheduler.pool(PROFILES[profile], "fcfs", num_blocks)  # as the emulated node's pool
    reqs = schedule(rate, seconds, seed=11, kinds=kinds)
    t, i, done = 0.0, 0, 0
    lo = seconds * 0.3
    while t < seconds:
        while i < len(reqs) and reqs[i].at_s <= t:
            r = reqs[i]
            s.add(
                Seq(
                    r.prompt_tokens,
                    r.max_tokens,
                    arrival=r.at_s,
                    hashes=prefix_hashes(r, s.p.block_size),
                )
            )
            i += 1
        if s.idle():
            t = reqs[i].at_s if i < len(reqs) else seconds
            continue
        r = s.step(t)
        t += max(r.duration_s, 1e-4)
        done += sum(1 for q in r.finished if lo <= t < seconds)
    return done / (seconds - lo)


def prefix_hashes(r: Req, block_size: int) -> tuple[int, ...]:
    """The block hashes of a request's shared prefix (its kind's per tenant, or the one of its
    kind's prefixes it uses), then of its conversation so far, as the engine's prefix cache
    keys them; the rest of a prompt is its own and never matches."""
    key = r.prefix_key or (r.kind, r.tenant)
    head = tuple(hash((key, i)) for i in range(r.prefix_tokens // block_size))
    if not r.conversation:
        return head
    n = r.prompt_tokens // block_size - len(head)
    return head + tuple(hash((r.conversation, len(head), i)) for i in range(n))


def computed_prompt(r: Req, block_size: int) -> int:
    """Prompt tokens an engine computes for `r` once its shared prefix is cached (whole blocks;
    never the whole prompt: the last token is always computed)."""
    shared = max(r.prefix_tokens, r.history_tokens)
    return r.prompt_tokens - min(shared // block_size * block_size, r.prompt_tokens - 1)


def capacity(
    profile: str,
    seconds: float = 120,
    kinds: tuple[Kind, ...] = MIXED,
    num_blocks: int | None = None,
) -> float:
    """Requests/s one node sustains for `kinds` (saturating completion rate); `num_blocks`:
    its KV pool when not the profile's (--num-gpu-blocks-override)."""
    best, best_rate = 0.0, 0.0
    rate = 0.25
    saturated = 0

    def at(rate: float) -> float:
        # At least ~500 completions in the measured window: at low rates a short window's
        # Poisson noise looked like saturation (a prefill-heavy mix calibrated at 1/8 of its
        # real capacity).
        return completed_rate(profile, rate, max(seconds, 700 / rate), kinds, num_blocks)

    while rate < 2000 and saturated < 3:
        got = at(rate)
        if got > best:
            best, best_rate = got, rate
        # Saturated: more offered load is not served. A heavy mix can look saturated at one
        # step while long requests are still in flight at the window's end: go three steps on.
        saturated = saturated + 1 if got < 0.9 * rate else 0
        rate *= 1.25
    # Past saturation an engine that preempts serves less than at it (recomputed prompts): the
    # peak can lie between two steps of 25 %, so look between the best one and the next.
    for f in (1.05, 1.1, 1.15, 1.2):
        best = max(best, at(best_rate * f))
    return best


def demand(profile: str, reqs: Iterable[Req], nodes: int, seconds: float) -> dict[str, float]:
    """Compute each class offers over the arrival window, as a fraction of the cluster's: every
    prompt and output token at the profile's roofline cost (2 x params FLOPs), a lower bound on
    what serving it takes (memory-bound decode steps and per-step overhead cost more)."""
    per_token, bs = PROFILES[profile].compute_s_per_token, PROFILES[profile].block_size
    spent: dict[str, float] = defaultdict(float)
    for r in reqs:  # a cached shared prefix is not computed again
        spent[r.cls] += (computed_prompt(r, bs) + r.max_tokens) * per_token
    return {cls: s / (nodes * seconds) for cls, s in spent.items()}


def first_token_bound(
    profile: str,
    reqs: list[Req],
    cls: str,
    before: Iterable[str],
    nodes: int,
    seconds: float,
    target_s: float,
) -> float:
    """The largest fraction of `cls`'s requests that any order can give a first token within
    `target_s` while the classes `before` it get theirs within the window: every such prompt
    must be prefilled by the window's end + the target, so the prefills of `before` and of the
    served part of `cls` fit in the cluster's compute until then; the most requests fit
    shortest first. Prefill only, at roofline cost (decode and per-step overhead left out), so
    it is an upper bound: a target above it cannot be met by any scheduler."""
    per_token, bs = PROFILES[profile].compute_s_per_token, PROFILES[profile].block_size
    ahead = set(before)
    mine = sorted(computed_prompt(r, bs) * per_token for r in reqs if r.cls == cls)
    if not mine:
        return 1.0
    left = nodes * (seconds + target_s) - sum(
        computed_prompt(r, bs) * per_token for r in reqs if r.cls in ahead
    )
    served = 0
    for cost in mine:
        if cost > left + 1e-9:  # rounding in the running sum
            break
        left -= cost
        served += 1
    return served / len(mine)


def bounds_line(
    profile: str, reqs: list[Req], nodes: int, seconds: float, order: list[tuple[str, float | None]]
) -> str:
    """One line for a benchmark's header: each class's offered compute, and for every class with
    a TTFT target the most of it any scheduler serves in time behind the classes before it
    (`order`: (class, TTFT target s or None), most urgent first). Where conversation turns are
    among them, the figure is said to be the schedule's only: a turn is sent once the last
    one's answer came, so the arrivals are the system's, not the schedule's."""
    offered = demand(profile, reqs, nodes, seconds)
    shares = ", ".join(f"{c} {offered[c]:.2f}" for c, _t in order if c in offered)
    out = [f"offered compute, share of the cluster at roofline cost: {shares}"]
    for i, (cls, target) in enumerate(order):
        if target is None or cls not in offered:
            continue
        before = [c for c, _t in order[:i]]
        bound = first_token_bound(profile, reqs, cls, before, nodes, seconds, target)
        # A conversation's turn waits for the last one's answer (drive.py): sent later than
        # scheduled, its prefill may come later too, and the schedule's figure bounds nothing.
        if any(r.conversation for r in reqs if r.cls == cls or r.cls in before):
            claim = f"{bound:.0%} if every turn went out on schedule (turns wait for answers: not a bound)"
        else:
            claim = f"at most {bound:.0%} (any order)"
        out.append(
            f"{cls} with a first token in time behind {'+'.join(before) or 'nothing'}: {claim}"
        )
    return "; ".join(out)


if __name__ == "__main__":
    import sys

    prof = sys.argv[1] if len(sys.argv) > 1 else "a100-40gb-llama3-8b"
    print(f"{prof}: {capacity(prof):.1f} req/s per node for the mixed workload")
