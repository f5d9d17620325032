"""`python -m engine`: run one emulated vLLM node (see engine.emulator, engine.api)."""

from __future__ import annotations

import argparse

from engine.api import serve
from engine.profiles import PROFILES


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--profile", default="a100-40gb-llama3-8b", choices=sorted(PROFILES))
    p.add_argument("--scheduling-policy", default="priority", choices=["priority", "fcfs"])
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--served-model-name")
    p.add_argument("--start-delay-s", type=float, default=0.0, help="fault injection: slow start")
    p.add_argument("--max-num-queued-tokens", type=int, default=0, help="vLLM's valve (0 = off)")
    p.add_argument("--max-num-queued-reqs", type=int, default=0, help="vLLM's valve (0 = off)")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as vLLM V1: on unless --no-enable-prefix-caching",
    )
    p.add_argument(
        "--tokenizer", default="", help="a tokenizer.json: count prompts as that real node does"
    )
    a = p.parse_args()
    serve(
        a.port,
        a.profile,
        a.scheduling_policy,
        a.num_gpu_blocks_override,
        a.served_model_name,
        a.start_delay_s,
        max_queued_tokens=a.max_num_queued_tokens,
        max_queued_reqs=a.max_num_queued_reqs,
        prefix_caching=a.enable_prefix_caching,
        tokenizer=a.tokenizer,
    )


if __name__ == "__main__":
    main()
