"""Weighted fairness where it matters: backlogged tenants of one class, through the real edge.

Three realtime tenants of weights 5:3:1 send identical requests from 48 closed-loop clients
each to one emulated node that takes 8 at a time. The backlog forms in the sidecar's queue (not
inside the engine), so the served split must follow the weights: 55.6 / 33.3 / 11.1 %, each
within ±3 points.

The same 48 clients per tenant on `admission up`'s defaults (two sidecars, one emulated A100
node taking 256 at a time): all 144 requests run at once, nothing waits, and the engine gives
every running request a token per step — there is nothing for weights to order, and holding
any tenant back would only idle the node (docs/benchmarks.md, "Fairness on `admission up`'s
defaults"). The property there is work conservation: nobody refused or held, every tenant
served alike (but for one short spell a stall of the host can start: see the test).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from admission.scheduling.overload import FULL_S
from devstack.stack import DEFAULT_POLICY, Stack
from loadtest.bench import gate_counts

pytestmark = pytest.mark.timeout(240)

WEIGHTS = {"gold-5": 5, "silver-3": 3, "bronze-1": 1}


def _tenants() -> dict[str, object]:
    lifted = {
        "requests_per_s": 1e6,
        "request_burst": 10**6,
        "tokens_per_min": 1e9,
        "token_burst": 10**9,
    }
    return {
        t: {"weight": w, "keys": [f"plain:sk-{t}"], "classes": ["realtime"], "limits": lifted}
        for t, w in WEIGHTS.items()
    }


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        DEFAULT_POLICY,
        tmp_path_factory.mktemp("fair"),
        nodes=1,
        sidecars=1,
        profile="tiny",
        policy_overrides={"tenants": _tenants()},
        node_max_inflight=8,
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def _gates(sidecar_url: str) -> dict[str, object]:
    """Why a node said no to realtime, as one sidecar counted (admission_node_gate_total), and
    its view of the node: to say, when a request was refused, which rule held it."""
    out: dict[str, object] = dict(gate_counts(sidecar_url).get("realtime", {}))
    with urllib.request.urlopen(f"{sidecar_url}/status.json", timeout=5) as r:
        for node in json.loads(r.read())["nodes"]:
            for k in ("prefill_rate", "pending_prefill_tokens", "tpot_ms", "inflight"):
                out[f"{node['node']}.{k}"] = node[k]
    return out


def _code(answer: bytes) -> str:
    """The refusal's reason (error.code), so that a failure says which gate refused."""
    try:
        return str(json.loads(answer)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def _saturate(
    url: str, seconds: float, warmup_s: float, model: str = "tiny", spell: list[float] | None = None
) -> Counter[str]:
    """Answers per tenant inside the window; refusals as `refused:<status>:<code>`, and when
    each came (seconds from the start) in `spell`."""
    spell = [] if spell is None else spell
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 16}
    ).encode()
    served: Counter[str] = Counter()
    start = time.monotonic()
    stop_at = start + warmup_s + seconds
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as s:

        async def client(tenant: str) -> None:
            headers = {"Authorization": f"Bearer sk-{tenant}", "Content-Type": "application/json"}
            while time.monotonic() < stop_at:
                async with s.post(url, data=body, headers=headers) as r:
                    answer = await r.read()
                    done = time.monotonic()
                    # Only answers inside the window: each client's last request is answered
                    # after it, once the queue drains, and would add 48 to every tenant alike.
                    if r.status == 200 and start + warmup_s < done < stop_at:
                        served[tenant] += 1
                    elif r.status != 200:
                        served[f"refused:{r.status}:{_code(answer)}"] += 1
                        spell.append(done - start)

        await asyncio.gather(*(client(t) for t in WEIGHTS for _ in range(48)))
    return served


def test_backlogged_tenants_share_by_weight(edge: Stack) -> None:
    served = asyncio.run(_saturate(f"{edge.url}/v1/chat/completions", 10.0, 3.0))
    total = sum(served[t] for t in WEIGHTS)  # refusals (late, past the node's 8) not counted
    assert total > 200, served
    wsum = sum(WEIGHTS.values())
    for tenant, w in WEIGHTS.items():
        got, want = served[tenant] / total, w / wsum
        print(f"{tenant}: {got:.1%} (target {want:.1%})")
        assert abs(got - want) <= 0.03, (tenant, served)


def test_on_the_shipped_defaults_nobody_is_held_while_the_node_has_room(
    tmp_path: pathlib.Path,
) -> None:
    s = Stack(DEFAULT_POLICY, tmp_path, nodes=1, policy_overrides={"tenants": _tenants()})
    try:
        s.start()
        url = f"{s.url}/v1/chat/completions"
        spell: list[float] = []
        served = asyncio.run(_saturate(url, 10.0, 3.0, model="llama-3-8b", spell=spell))
        gates = _gates(s.sidecar_url)
    finally:
        s.stop()
    refused = {k: n for k, n in served.items() if k.startswith("refused:")}
    if refused:
        # A stall of the host (these two cores run the node, both sidecars, NGINX and the
        # 144 clients) can put the ledger's pending prefill ahead of the node for a moment: a
        # few realtime requests queue, one is refused late, and the class is past capacity
        # until arrivals have found a node for overload.FULL_S (docs/benchmarks.md, "The rare
        # refusals on `admission up`'s defaults"). Seen 3 times in ~30 runs beside other
        # tests, 0 alone. Allowed as that one spell only: started by a late refusal, the early
        # ones by tenant weight after it, over within FULL_S + 3 s — never another reason, nor
        # refusals spread over the run.
        assert set(refused) <= {"refused:429:slo_unreachable", "refused:429:over_fair_share"}, (
            served,
            gates,
        )
        assert "refused:429:slo_unreachable" in refused, (served, gates)
        assert max(spell) - min(spell) <= FULL_S + 3.0, (min(spell), max(spell), served, gates)
        print(f"one spell of refusals, {min(spell):.1f}–{max(spell):.1f} s: {refused}, {gates}")
    total = sum(served[t] for t in WEIGHTS)
    assert total > 1000, served  # 144 at once through one A100: hundreds a second
    for tenant in WEIGHTS:
        got = served[tenant] / total
        print(f"{tenant}: {got:.1%} (alike: 33.3 %)")
        assert abs(got - 1 / 3) <= 0.03, (tenant, served)
