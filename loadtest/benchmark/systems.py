"""The systems the benchmark compares the product with: stock NGINX in front of the nodes (with
limit_req, least_conn, vLLM's own queue valve) and vLLM's own router."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from admission.policy import load_policy
from devstack.procs import free_port
from engine.profiles import PROFILES


def demo_keys(policy_path: Path) -> dict[str, str]:
    return {t.id: t.demo_keys[0] for t in load_policy(policy_path).tenants.values() if t.demo_keys}


def plain_nginx(run: Path, port: int, node_ports: list[int], system: str, policy_path: Path) -> str:
    """nginx.conf for the systems without the admission edge."""
    policy = load_policy(policy_path)
    keys = demo_keys(policy_path)
    balance = "least_conn;" if system in ("limit_req", "vllm_priority_lc") else ""
    servers = "\n".join(f"server 127.0.0.1:{p} max_fails=0;" for p in node_ports)
    limit_http = limit_loc = ""
    if system == "limit_req":
        for t in policy.tenants.values():
            if t.id in keys:
                zone = t.id.replace("-", "_")
                limit_http += (
                    f'map $http_authorization $lim_{zone} {{ default ""; "Bearer {keys[t.id]}" $binary_remote_addr; }}\n'
                    f"limit_req_zone $lim_{zone} zone={zone}:1m rate={max(1, int(t.limits.requests_per_s))}r/s;\n"
                )
                limit_loc += f"limit_req zone={zone} burst={t.limits.request_burst} nodelay;\n"
    return f"""
daemon off; worker_processes 2; pid {run}/nginx.pid; error_log {run}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; client_body_temp_path {run}/cb; proxy_temp_path {run}/px;
  fastcgi_temp_path {run}/fc; uwsgi_temp_path {run}/uw; scgi_temp_path {run}/sc;
  limit_req_status 429;
  {limit_http}
  upstream nodes {{ {balance} {servers} keepalive 256; keepalive_timeout 4s; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    client_max_body_size 1m; client_body_buffer_size 1m;
    location / {{ {limit_loc} proxy_pass http://nodes; proxy_http_version 1.1; proxy_set_header Connection "";
                 proxy_buffering off; proxy_read_timeout 600s; }}
  }}
}}"""


def valves(a: argparse.Namespace, system: str) -> tuple[str, ...]:
    """vLLM's queue valve for the strongest baseline: target TTFT (realtime's) × the node's
    prefill throughput, as vLLM's docs size --max-num-queued-tokens."""
    if system != "vllm_priority_lc" or a.engine != "sim":
        return ()
    p = PROFILES[a.profile]
    rate = p.max_num_batched_tokens / p.step_s(p.max_num_batched_tokens, 0)
    target_s = 1.0
    for c in load_policy(a.policy).classes.values():
        if c.slo_ttft_ms:
            target_s = c.slo_ttft_ms / 1000
            break
    return ("--max-num-queued-tokens", str(int(rate * target_s)))


def router(run: Path, port: int, node_ports: list[int]) -> subprocess.Popen[bytes]:
    """vLLM's router with its defaults (cache_aware, cache threshold 0.3, balance thresholds
    1.5x / 64), on its own port; its Prometheus exporter on a free one (it panics at start if
    its default 29000 is taken)."""
    exe = Path(sys.executable).with_name("vllm-router")
    if not exe.exists():
        raise SystemExit("vllm-router is not installed: scripts/setup.sh installs the load extras")
    workers = [f"http://127.0.0.1:{p}" for p in node_ports]
    log = (run / "vllm-router.log").open("ab")
    return subprocess.Popen(
        [
            str(exe),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "cache_aware",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
            "--worker-urls",
            *workers,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
