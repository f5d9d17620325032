"""The weighted-fair priority queue with aging. Pure: no I/O, time is passed in.

Two levels of stride scheduling (virtual "pass" values, cost in tokens):
- classes: each backlogged class advances by cost / share, where share is its weight among the
  backlogged classes, raised to its min_share when the weights would give less. An idle class
  is skipped (its share is borrowed) and re-enters at the current virtual time, so it cannot
  bank credit while idle: busy → proportional, idle → borrow.
- tenants inside a class: each advances by cost / weight (weighted fair queuing on virtual
  finish time), so a tenant sending long requests spends its share faster.
  A lane that empties comes back at the later of the class's virtual time and its own last
  finish tag (start-time fair queuing), and a request admitted without queueing (`charge`)
  counts too: with one request each waiting, lanes restarting at the virtual time used to tie
  and the lowest tenant id won every pop.
Inside one tenant and class, arrival order.

Aging: a request that has waited `promote_after_s` in its class moves to the tail of the next
more urgent class (and may climb again), so starvation is impossible. Long requests (estimated
tokens above `queue.long_request_tokens`) start one class lower.

Cancellation is lazy (an item is flagged and skipped at the head), so it is O(1).

One job over 350 lines: the two levels of stride scheduling share one virtual clock,
the aging and the bounds; split, each level would reach into the other's lanes.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from admission.errors import QueueFull
from admission.policy import Policy
from admission.scheduling.prefixes import NO_PREFIX, Prefix

_seq = itertools.count()
MAX_DONE = 4096  # tenants' last finish tags kept per class before those now behind vtime go


@dataclass(eq=False)
class Item:
    """One waiting request. `cost` is in tokens: the prompt estimate and its answer as long as
    its tenant's answers of the class run, at most max_tokens (Dispatcher.admit): what the node
    books for it and what fairness charges."""

    tenant: str
    cls: str
    cost: int
    model: str
    enqueued_at: float
    deadline_at: float
    class_since: float = 0.0
    rid: str = ""
    prompt: int = 0  # prompt tokens (estimate): the prefill this request books on a node
    asked: int = 0  # prompt + max_tokens (its cap): what `long_request_tokens` judges
    prefix: Prefix = NO_PREFIX  # the prompt's head (prefixes.py): routing and booking use it
    requested_cls: str = ""
    held_at: float = 0.0  # when fairness across sidecars first held it back (shares.py; 0: never)
    payload: Any = None
    cancelled: bool = False
    dispatched: bool = False
    promotions: int = 0
    charged: tuple[float, float] = (0.0, 0.0)  # (lane, class) pass advance of its last pop
    # Tickets whose lease was refused after its round trip had been sent more than once: an
    # earlier copy may still book it (Redis stalled with it unread). Given back for good when
    # the request ends on another ticket (Dispatcher.admit).
    stale: tuple[str, ...] = ()
    seq: int = field(default_factory=lambda: next(_seq))


class _Lane:
    """A tenant's FIFO inside one class."""

    __slots__ = ("items", "live", "pass_")

    def __init__(self, pass_: float) -> None:
        self.items: deque[Item] = deque()
        self.live = 0
        self.pass_ = pass_

    def head(self) -> Item | None:
        while self.items and self.items[0].cancelled:
            self.items.popleft()
        return self.items[0] if self.items else None


class _ClassQ:
    __slots__ = ("done", "lanes", "live", "pass_", "vtime")

    def __init__(self) -> None:
        self.lanes: dict[str, _Lane] = {}
        self.live = 0
        self.pass_ = 0.0
        self.vtime = 0.0  # tenant-level virtual time inside this class
        # tenant → its pass when its lane last emptied (start-time fair queuing's last finish
        # tag): it comes back at max(vtime, this), so a tenant served one request at a time —
        # its lane emptied at each pop, as under overload when late refusals drain the lanes —
        # still pays for what it was served (it used to come back at vtime: arrival order).
        self.done: dict[str, float] = {}

    def lane(self, tenant: str) -> _Lane:
        """`tenant`'s lane, made at its start tag if it had none."""
        lane = self.lanes.get(tenant)
        if lane is None:
            lane = self.lanes[tenant] = _Lane(max(self.vtime, self.done.pop(tenant, 0.0)))
        return lane


class FairQueue:
    """Weighted-fair, aging priority queue of `Item`s, bounded globally and per tenant."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._classes: dict[str, _ClassQ] = {name: _ClassQ() for name in policy.classes}
        self._rank = {name: i for i, name in enumerate(policy.classes)}
        self._vtime = 0.0  # class-level virtual time
        self._live = 0
        self._per_tenant: dict[str, int] = {}
        self._kv: dict[str, int] = {}  # tokens (cost) waiting, by the class each asked for
        # (model, class asked for) → tenant → requests waiting (shares.py: fairness across sidecars)
        self._pairs: dict[tuple[str, str], dict[str, int]] = {}
        self._drain_rate = 0.0  # pops per second (EWMA), for Retry-After
        self._last_pop: float | None = None

    # -- size -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._live

    def depth(self, cls: str) -> int:
        q = self._classes.get(cls)
        return q.live if q else 0

    def waiting_at_or_above(self, cls: str) -> int:
        """Requests waiting in `cls` or a more urgent class (promoted ones included)."""
        top = self._rank.get(cls, len(self._rank))
        return sum(q.live for n, q in self._classes.items() if self._rank[n] <= top)

    def waiting_kv(self, cls: str) -> int:
        """Tokens (prompt estimate + output cap) of the requests waiting that asked for `cls`."""
        return self._kv.get(cls, 0)

    def tenant_depth(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def waiting_in(self, model: str, cls: str) -> dict[str, int]:
        """Tenant → its requests waiting for `model` that asked for `cls`."""
        return self._pairs.get((model, cls), {})

    def waiting_tenants(self) -> dict[tuple[str, str], dict[str, float]]:
        """(model, class asked for) → tenant → when its oldest request there at the head of a
        lane arrived (monotonic; the lanes' heads are their oldest)."""
        out: dict[tuple[str, str], dict[str, float]] = {p: {} for p in self._pairs}
        for q in self._classes.values():
            for tenant, lane in q.lanes.items():
                head = lane.head()
                if head is None:
                    continue
                pair = out.get((head.model, head.requested_cls))
                if pair is not None and tenant in self._pairs[(head.model, head.requested_cls)]:
                    pair[tenant] = min(pair.get(tenant, head.enqueued_at), head.enqueued_at)
        return out

    def items(self) -> Iterator[Item]:
        for q in self._classes.values():
            for lane in q.lanes.values():
                yield from (i for i in lane.items if not i.cancelled)

    # -- policy -----------------------------------------------------------------------------
    def set_policy(self, policy: Policy) -> None:
        """Swap in a reloaded policy. Items of a removed class move to the least urgent class."""
        self.policy = policy
        self._rank = {name: i for i, name in enumerate(policy.classes)}
        old = self._classes
        self._classes = {name: old.get(name) or _ClassQ() for name in policy.classes}
        fallback = list(policy.classes)[-1]
        for name, q in old.items():
            if name in self._classes:
                continue
            for lane in q.lanes.values():
                for item in lane.items:
                    if not item.cancelled:
                        item.cls = fallback
                        self._append(item)

    # -- enqueue / cancel -------------------------------------------------------------------
    def push(self, item: Item) -> None:
        """Enqueue, or raise QueueFull (nothing changes) when a bound is reached."""
        p = self.policy
        t = p.tenants.get(item.tenant)
        tenant_max = (t.limits.max_queued if t else 0) or p.queue.max_depth_per_tenant
        if self._live >= p.queue.max_depth:
            raise QueueFull("global", self.retry_after(self._live))
        if self.tenant_depth(item.tenant) >= tenant_max:
            raise QueueFull("tenant", self.retry_after(self._live))
        item.requested_cls = item.requested_cls or item.cls
        # The cap, not the booking: a tenant cannot shrink its own booking below the threshold
        # (answers learned short) and keep a long request in its class.
        if p.queue.long_request_tokens and max(item.cost, item.asked) > p.queue.long_request_tokens:
            item.cls = p.class_below(item.cls)
        item.class_since = item.enqueued_at
        self._append(item)
        self._count(item, 1)

    def cancel(self, item: Item) -> bool:
        """Remove a waiting item (deadline passed, client gone). False if it already left."""
        if item.cancelled or item.dispatched:
            return False
        item.cancelled = True
        self._forget(item)
        return True

    # -- dispatch ---------------------------------------------------------------------------
    def pop(self, now: float, eligible: Callable[[Item], bool] = lambda _i: True) -> Item | None:
        """Remove and return the next item to run among those `eligible` accepts (e.g. whose
        model has a node with room), in weighted-fair order; None if there is none."""
        backlogged = [(n, q) for n, q in self._classes.items() if q.live > 0]
        if not backlogged:
            return None
        shares = self._shares([n for n, _ in backlogged])
        rank = self._rank
        classes = self.policy.classes
        slo_blocked = False
        # Ties go to the more urgent class (policy order), then to the lower tenant id.
        for name, q in sorted(backlogged, key=lambda nq: (nq[1].pass_, rank[nq[0]])):
            if slo_blocked and not classes[name].slo_ttft_ms:
                continue  # no SLO: it does not take room that a waiting SLO class cannot use yet
            slo_blocked = slo_blocked or bool(classes[name].slo_ttft_ms)
            for tenant, lane in sorted(q.lanes.items(), key=lambda tl: (tl[1].pass_, tl[0])):
                head = lane.head()
                if head is None or not eligible(head):
                    continue
                lane.items.popleft()
                weight = self._tenant_weight(tenant)
                q.vtime = max(q.vtime, lane.pass_)
                head.charged = (head.cost / weight, max(head.cost, 1) / shares[name])
                lane.pass_ += head.charged[0]
                self._vtime = max(self._vtime, q.pass_)
                q.pass_ += head.charged[1]
                self._forget(head)
                head.dispatched = True
                self._note_pop(now)
                return head
        return None

    def drop_heads(self, cls: str, late: Callable[[Item], bool]) -> list[Item]:
        """Remove and return, from the head of each of `cls`'s tenant lanes, the items `late`
        says can no longer be served in time (lanes are in arrival order: the oldest first)."""
        q = self._classes.get(cls)
        out: list[Item] = []
        if q is None:
            return out
        for lane in list(q.lanes.values()):
            while (head := lane.head()) is not None and late(head):
                head.cancelled = True
                self._forget(head)
                out.append(head)
        return out

    def charge(self, item: Item) -> None:
        """Count a request admitted without waiting (the dispatcher's fast path, taken only
        while none of its class waits here: its tenant has no lane) as a pop would have: a
        tenant served while the queue was empty still pays for it once a backlog forms."""
        q = self._classes.get(item.cls)
        if q is None:
            return
        q.vtime = start = max(q.vtime, q.done.get(item.tenant, 0.0))
        q.done[item.tenant] = start + item.cost / self._tenant_weight(item.tenant)

    def requeue_front(self, item: Item) -> None:
        """Put a popped item back at the head of its lane (its node lease was refused), and
        take back what its pop charged: a tenant does not pay for a turn it did not get."""
        item.dispatched = False
        if item.cls not in self._classes:  # its class was removed by a reload meanwhile
            item.cls = list(self.policy.classes)[-1]
            item.charged = (0.0, 0.0)
        q = self._classes[item.cls]
        q.pass_ -= item.charged[1]
        lane = q.lanes.get(item.tenant)
        if lane is None:  # emptied by the pop: back at the pass it had before it
            lane = q.lane(item.tenant)
            lane.pass_ = max(q.vtime, lane.pass_ - item.charged[0])
        else:
            lane.pass_ -= item.charged[0]
        item.charged = (0.0, 0.0)
        lane.items.appendleft(item)
        lane.live += 1
        q.live += 1
        self._count(item, 1)

    def age(self, now: float) -> int:
        """Promote every item that has waited its class's promote_after_s; return how many."""
        moved = 0
        order = list(self._classes)
        for i, name in enumerate(order):
            limit = self.policy.classes[name].promote_after_s
            if limit is None or i == 0:
                continue
            q = self._classes[name]
            for lane in list(q.lanes.values()):
                while (head := lane.head()) is not None and now - head.class_since >= limit:
                    lane.items.popleft()
                    lane.live -= 1
                    q.live -= 1
                    head.cls = order[i - 1]
                    head.class_since = now
                    head.promotions += 1
                    self._append(head)
                    moved += 1
        return moved

    def retry_after(self, position: int) -> float:
        """Seconds until a request at `position` would likely be dispatched (≥ 1)."""
        if self._drain_rate <= 0:
            return 1.0
        return max(1.0, min(60.0, position / self._drain_rate))

    # -- internals --------------------------------------------------------------------------
    def _shares(self, names: list[str]) -> dict[str, float]:
        """Weight shares among backlogged classes, raised to min_share where needed. While a
        class with an SLO is backlogged, classes without one get their min_share only: work
        that has no deadline does not take capacity from work that still can meet one."""
        classes = self.policy.classes
        fixed: dict[str, float] = {}
        if any(classes[n].slo_ttft_ms for n in names):
            fixed = {n: classes[n].min_share for n in names if not classes[n].slo_ttft_ms}
        while True:
            free = [n for n in names if n not in fixed]
            rest = 1.0 - sum(fixed.values())
            total = sum(classes[n].weight for n in free)
            shares = {n: rest * classes[n].weight / total for n in free} if total else {}
            low = [n for n in free if shares[n] < classes[n].min_share]
            if not low:
                shares.update(fixed)
                return {n: max(s, 1e-9) for n, s in shares.items()}
            for n in low:
                fixed[n] = classes[n].min_share

    def _tenant_weight(self, tenant: str) -> float:
        return self.policy.weight_of(tenant)

    def _append(self, item: Item) -> None:
        q = self._classes[item.cls]
        if q.live == 0:
            # Re-entering after idle: start at the current virtual time (no banked credit).
            q.pass_ = max(q.pass_, self._vtime)
        lane = q.lane(item.tenant)
        if lane.live == 0:
            lane.pass_ = max(lane.pass_, q.vtime)
        lane.items.append(item)
        lane.live += 1
        q.live += 1

    def _forget(self, item: Item) -> None:
        q = self._classes.get(item.cls)
        if q is not None:
            lane = q.lanes.get(item.tenant)
            if lane is not None:
                lane.live -= 1
                if lane.live == 0 and not lane.head():
                    del q.lanes[item.tenant]
                    if lane.pass_ > q.vtime:  # at or below vtime it starts at vtime anyway
                        q.done[item.tenant] = lane.pass_
                    if len(q.done) > MAX_DONE:
                        q.done = {t: p for t, p in q.done.items() if p > q.vtime}
            q.live -= 1
        self._count(item, -1)

    def _count(self, item: Item, n: int) -> None:
        """Add (1) or take away (-1) a waiting item from the totals."""
        self._live += n
        left = self._per_tenant.get(item.tenant, 0) + n
        if left > 0:
            self._per_tenant[item.tenant] = left
        else:
            self._per_tenant.pop(item.tenant, None)
        pair = self._pairs.setdefault((item.model, item.requested_cls), {})
        if (waiting := pair.get(item.tenant, 0) + n) > 0:
            pair[item.tenant] = waiting
        else:
            pair.pop(item.tenant, None)
            if not pair:
                del self._pairs[(item.model, item.requested_cls)]
        kv = self._kv.get(item.requested_cls, 0) + n * item.cost
        if kv > 0:
            self._kv[item.requested_cls] = kv
        else:
            self._kv.pop(item.requested_cls, None)

    def _note_pop(self, now: float) -> None:
        if self._last_pop is not None:
            gap = max(now - self._last_pop, 1e-6)
            self._drain_rate = 0.9 * self._drain_rate + 0.1 * (1.0 / gap)
        self._last_pop = now
