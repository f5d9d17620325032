"""Benchmark: the dispatcher's queue with 10,000 requests waiting, and shares under saturation.

    .venv/bin/python -m loadtest.bench_queue [--queued 10000] [--tenants 50]

Prints (1) decisions per second and CPU per decision of `FairQueue.pop` + `age` with the queue
held at `--queued` requests spread over 3 classes and `--tenants` tenants (each decision is
replaced by a new request of the same tenant and class, so every lane stays backlogged), and (2) measured class and tenant shares of
admitted tokens vs their weights in a saturated run with mixed request sizes.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections import Counter

from admission.policy import parse_policy
from admission.scheduling.queue import FairQueue, Item

POLICY = """
redis: {{url: "redis://127.0.0.1:1/0"}}
queue: {{max_depth: 1000000, max_depth_per_tenant: 1000000}}
classes:
  realtime: {{weight: 8, min_share: 0.1, priority: 0, deadline_s: 10}}
  batch: {{weight: 3, min_share: 0.1, priority: 1, deadline_s: 60, promote_after_s: 1000}}
  offline: {{weight: 1, min_share: 0.05, priority: 2, deadline_s: 600, promote_after_s: 1000}}
tiers: {{platinum: 5, gold: 3, free: 1}}
tenants:
{tenants}
nodes: {{n: {{url: "http://x", models: [m]}}}}
"""
TIERS = ["platinum", "gold", "free"]


def build(n_tenants: int) -> FairQueue:
    lines = [
        f'  t{i}: {{tier: {TIERS[i % 3]}, keys: ["sha256:{hashlib.sha256(f"k{i}".encode()).hexdigest()}"], limits: {{requests_per_s: 1, tokens_per_min: 1}}}}'
        for i in range(n_tenants)
    ]
    return FairQueue(parse_policy(POLICY.format(tenants="\n".join(lines))))


def arrival(rng: random.Random, n_tenants: int, now: float) -> Item:
    cls = rng.choices(["realtime", "batch", "offline"], [0.6, 0.3, 0.1])[0]
    cost = rng.choice([200, 400, 800]) if cls == "realtime" else rng.choice([2000, 8000])
    return Item(f"t{rng.randrange(n_tenants)}", cls, cost, "m", now, now + 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--tenants", type=int, default=50)
    ap.add_argument("--decisions", type=int, default=50_000)
    a = ap.parse_args()
    rng = random.Random(1)
    q = build(a.tenants)
    for _ in range(a.queued):
        q.push(arrival(rng, a.tenants, 0.0))
    served_cls: Counter[str] = Counter()
    served_tenant: Counter[str] = Counter()
    now = 0.0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(a.decisions):
        now += 0.001
        q.age(now)
        it = q.pop(now, lambda _i: True)
        assert it is not None
        served_cls[it.cls] += it.cost
        if it.cls == "realtime":
            served_tenant[it.tenant] += it.cost
        # Saturation: every lane stays backlogged (the popped request's tenant and class send
        # another, of a random size), so shares show the weights, not the arrival mix.
        nxt = arrival(rng, a.tenants, now)
        nxt.tenant, nxt.cls = it.tenant, it.requested_cls or it.cls
        q.push(nxt)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(
        f"{a.decisions:,} decisions with {len(q):,} queued ({a.tenants} tenants, 3 classes): "
        f"{a.decisions / wall:,.0f} decisions/s, {cpu / a.decisions * 1e6:.1f} µs CPU per decision"
    )
    total = sum(served_cls.values())
    weights = {"realtime": 8, "batch": 3, "offline": 1}
    print("class shares of admitted tokens (saturated):")
    for c, w in weights.items():
        want = w / sum(weights.values())
        got = served_cls[c] / total
        print(
            f"  {c:<9} weight {w}: want {want:6.1%}  got {got:6.1%}  ({(got - want) / want:+.1%})"
        )
    tier_tokens: Counter[str] = Counter()
    for t, tok in served_tenant.items():
        tier_tokens[TIERS[int(t[1:]) % 3]] += tok
    counts = Counter(TIERS[i % 3] for i in range(a.tenants))
    tw = {"platinum": 5, "gold": 3, "free": 1}
    denom = sum(tw[t] * counts[t] for t in tw)
    ttotal = sum(tier_tokens.values())
    print("realtime tenant shares by tier (sum over the tier's tenants):")
    for t in TIERS:
        want = tw[t] * counts[t] / denom
        got = tier_tokens[t] / ttotal
        print(
            f"  {t:<9} weight {tw[t]} × {counts[t]:>2}: want {want:6.1%}  got {got:6.1%}  ({(got - want) / want:+.1%})"
        )


if __name__ == "__main__":
    main()
