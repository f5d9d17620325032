"""An idealised schedule's first tokens in time: what leaving out the requests that can no longer
make their target is worth, in virtual time (no processes, seconds).

    .venv/bin/python -m loadtest.ideal --workload loadtest/workloads/llmd.yaml [--nodes 8]
        [--load 1.5] [--seconds 60] [--seed 7] [--cls realtime] [--target-s 1.0]

The class's requests (the benchmark's arrivals: the same seed, the same calibrated rate) go to
`--nodes` nodes that prefill one prompt after another, in chunks of the profile's
max_num_batched_tokens at its step cost, each prompt's prefix blocks cached on the node that
computed them (never evicted); decode, the other classes and the sidecar are left out. Each
request goes to the node where its first token comes soonest. Printed: the share with a first
token within the target when every request is sent (as the product does), and when a request
that would have it late everywhere is left out (its node stays free for the next), with when
the late ones were sent. Neither figure is a bound — another order can beat both, and decode
and other classes make both lower —: their difference is what leaving out requests that can no
longer make it is worth (docs/benchmarks.md, the llm-d-like mix's cold start).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.profiles import PROFILES, Profile
from loadtest.benchmark.capacity import capacity, prefix_hashes
from loadtest.workloads.mix import MIXED, Req, load_kinds, schedule


def prefill_s(p: Profile, tokens: int) -> float:
    """Seconds a node alone takes to prefill `tokens` prompt tokens, chunk by chunk."""
    out, left = 0.0, tokens
    while left > 0:
        chunk = min(left, p.max_num_batched_tokens)
        out += p.step_s(chunk, 0)
        left -= chunk
    return out


def first_tokens(
    p: Profile, reqs: Sequence[Req], nodes: int, target_s: float, leave_out: bool
) -> tuple[float, list[float]]:
    """(share of `reqs` with a first token within `target_s`, when the late ones were sent)."""
    free = [0.0] * nodes  # when each node's prefill queue is empty
    cached: list[set[int]] = [set() for _ in range(nodes)]
    in_time, late = 0, []
    for r in sorted(reqs, key=lambda r: r.at_s):
        blocks = prefix_hashes(r, p.block_size)
        best: tuple[float, int] | None = None
        for n in range(nodes):
            hit = 0
            while hit < len(blocks) and blocks[hit] in cached[n]:
                hit += 1
            computed = r.prompt_tokens - min(hit * p.block_size, r.prompt_tokens - 1)
            done = max(free[n], r.at_s) + prefill_s(p, computed)
            if best is None or done < best[0]:
                best = (done, n)
        assert best is not None
        done, n = best
        ok = done - r.at_s <= target_s
        in_time += int(ok)
        if not ok:
            late.append(r.at_s)
        if ok or not leave_out:
            free[n] = done
            cached[n].update(blocks)
    return (in_time / len(reqs) if reqs else 1.0), late


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", help="a YAML mix (default: the built-in one)")
    ap.add_argument("--profile", default="a100-40gb-llama3-8b", choices=sorted(PROFILES))
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--load", type=float, default=1.5)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cls", default="realtime")
    ap.add_argument("--target-s", type=float, default=1.0)
    a = ap.parse_args(argv)
    p = PROFILES[a.profile]
    kinds = load_kinds(a.workload) if a.workload else MIXED
    rate = capacity(p.name, kinds=kinds) * a.nodes * a.load  # as loadtest.bench calibrates
    reqs = [r for r in schedule(rate, a.seconds, seed=a.seed, kinds=kinds) if r.cls == a.cls]
    for leave_out in (False, True):
        share, late = first_tokens(p, reqs, a.nodes, a.target_s, leave_out)
        sent = ", ".join(f"{t:.1f}" for t in late[:12]) + (" ..." if len(late) > 12 else "")
        how = "leaving out the hopeless" if leave_out else "sending every request"
        print(
            f"{a.cls}, {how}: {share:.1%} within {a.target_s:g} s; "
            f"{len(late)} late, sent at {sent or '-'} s"
        )


if __name__ == "__main__":
    main()
