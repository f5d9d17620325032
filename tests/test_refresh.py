"""The node refresh's one pipeline on a real redis-server: the parts that ride it (Rider) take
their own replies, and one's failed reply neither fails the refresh nor reaches another."""

from __future__ import annotations

from typing import Any

from admission.limits import Limiter
from admission.metrics import Metrics
from admission.scheduling import Dispatcher
from admission.store import Store, connect
from devstack.procs import RedisServer
from tests.conftest import make_policy


class _Probe:
    """A rider that asks one command: a good GET, or an INCR on a hash (WRONGTYPE)."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.got = fail, [["not taken"]]

    def queue(self, pipe: Any) -> int:
        (pipe.incr if self.fail else pipe.get)("probe-hash" if self.fail else "probe-key")
        return 1

    def take(self, replies: list[Any]) -> None:
        self.got.append(replies)


async def test_a_riders_failed_reply_stays_its_own(redis: Any, redis_server: RedisServer) -> None:
    p = make_policy(redis_server.url)
    await redis.hset("probe-hash", "f", "1")
    await redis.set("probe-key", "v")
    client = connect(p.redis)
    st = Store.over(client, Metrics())
    metrics = Metrics()
    d = Dispatcher(st, Limiter(st, lambda: p, metrics), lambda: p, metrics)
    nt = d.nodes
    bad, good = _Probe(fail=True), _Probe(fail=False)
    nt.riders = [bad, *nt.riders, good]
    assert not nt.views["n1"].observed
    await nt.refresh()
    assert isinstance(bad.got[-1][0], Exception)  # in place, to its own rider
    assert good.got[-1] == [b"v"]  # the riders after it read their own replies
    assert nt.views["n1"].observed  # the node states were taken: not a failed refresh
    await client.aclose()
