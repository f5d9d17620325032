"""`admission up`: the whole stack on 127.0.0.1 in the foreground, and its clean shutdown.

Starts, in order: redis-server (unless the policy's Redis is reachable elsewhere and
--redis-url is given), the engine nodes (emulated or vLLM), the node agent, the sidecar
processes (unix sockets; the first also on a loopback admin port), and NGINX rendered from
nginx/*.conf. Everything runs in a run directory; Ctrl-C or SIGTERM stops every process
(each in its own process group) and removes the run directory's pid and socket files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from admission.policy import load_policy

ROOT = Path(__file__).resolve().parent.parent
NGINX_DIR = ROOT / "nginx"
MODULES = (
    "/usr/lib/nginx/modules/ndk_http_module.so",
    "/usr/lib/nginx/modules/ngx_http_lua_module.so",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(
    check: Any, timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not ready after {timeout_s}s")


def _port_open(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), 1):
        return True


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as r:
        return bool(r.status == 200)


class Stack:
    """The processes of one local stack. `start()` then `stop()`; usable from tests."""

    def __init__(
        self,
        policy_path: Path,
        run_dir: Path,
        *,
        engine: str = "sim",
        nodes: int = 2,
        port: int | None = None,
        sidecars: int = 2,
        profile: str = "a100-40gb-llama3-8b",
        redis_url: str | None = None,
        policy_overrides: dict[str, Any] | None = None,
        num_gpu_blocks: int | None = None,
        external_nodes: dict[str, Any] | None = None,
        extra_nginx_http: str = "",
    ) -> None:
        self.policy_path = policy_path
        self.run_dir = run_dir
        self.engine = engine
        self.n_nodes = nodes
        self.port = port or free_port()
        self.n_sidecars = sidecars
        self.profile = profile
        self.redis_url = redis_url
        self.overrides = policy_overrides or {}
        self.num_gpu_blocks = num_gpu_blocks
        self.external_nodes = external_nodes  # policy `nodes:` entries already running elsewhere
        self.extra_nginx_http = extra_nginx_http  # e.g. a benchmark's direct-proxy server block
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.node_ports: list[int] = []
        self.admin_port = free_port()
        self.runtime_policy = run_dir / "policies.yaml"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        log.close()
        self.procs.append((name, proc))
        return proc

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # NGINX workers run unprivileged and must reach the sockets and the edge table, which
        # the run directory's parents may not allow (pytest's tmp dirs are 0700).
        self.sock_dir = Path(tempfile.mkdtemp(prefix="admission-"))
        self.sock_dir.chmod(0o755)
        shutil.copytree(NGINX_DIR / "lua", self.sock_dir / "lua")  # the checkout may be 0700 too
        raw = yaml.safe_load(self.policy_path.read_text())
        if self.redis_url is None:
            rport = free_port()
            p = self._spawn("redis", ["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", str(self.run_dir)])  # fmt: skip
            self.redis_url = f"redis://127.0.0.1:{rport}/0"
            _wait(lambda: _port_open(rport), 10, "redis", p)
        raw.setdefault("redis", {})["url"] = self.redis_url
        raw["nodes"] = (
            self.external_nodes if self.external_nodes is not None else self._start_nodes()
        )
        for section, values in self.overrides.items():
            if isinstance(values, dict):
                raw.setdefault(section, {}).update(values)
            else:
                raw[section] = values
        self.runtime_policy.write_text(yaml.safe_dump(raw, sort_keys=False))
        policy = load_policy(self.runtime_policy)  # fails loudly on a bad combination
        py = sys.executable
        self._spawn(
            "agent", [py, "-m", "admission.cli", "agent", "--policy", str(self.runtime_policy)]
        )
        sockets = [self.sock_dir / f"sidecar-{i}.sock" for i in range(self.n_sidecars)]
        edge_table = self.sock_dir / "edge.json"
        for i, sock in enumerate(sockets):
            args = [py, "-m", "admission.cli", "serve", "--policy", str(self.runtime_policy),
                    "--unix", str(sock), "--edge-table", str(edge_table)]  # fmt: skip
            if i == 0:
                args += ["--port", str(self.admin_port)]
            p = self._spawn(f"sidecar-{i}", args)
            _wait(sock.exists, 30, f"sidecar {i}", p)
        self._write_nginx(policy.edge.max_body_bytes, sockets, edge_table)
        p = self._spawn(
            "nginx", ["nginx", "-c", str(self.run_dir / "nginx.conf"), "-p", str(self.run_dir)]
        )
        _wait(lambda: _http_ok(f"{self.url}/healthz"), 30, "nginx", p)
        for _ in range(100):  # nodes become open once the agent has sampled them
            with urllib.request.urlopen(f"{self.sidecar_url}/healthz", timeout=2) as r:
                import json

                states = json.load(r)["nodes"]
            if all(s == "open" for s in states.values()):
                break
            time.sleep(0.1)

    def _start_nodes(self) -> dict[str, Any]:
        nodes: dict[str, Any] = {}
        py = sys.executable
        for i in range(self.n_nodes):
            port = free_port()
            self.node_ports.append(port)
            nid = f"node-{i}"
            if self.engine == "sim":
                args = [py, "-m", "engine", "--port", str(port), "--profile", self.profile]
                if self.num_gpu_blocks:
                    args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
                p = self._spawn(nid, args)
                from engine.profiles import PROFILES

                model = PROFILES[self.profile].model
                nodes[nid] = {"url": f"http://127.0.0.1:{port}", "models": [model], "memory_source": "effective",
                              "device_url": f"http://127.0.0.1:{port}/sim/device", "max_inflight": 256}  # fmt: skip
                _wait(lambda port=port: _http_ok(f"http://127.0.0.1:{port}/health"), 30, nid, p)
            else:
                from engine.vllm_node import vllm_command

                args, env, model = vllm_command(
                    port, self.run_dir / "tiny-llama", self.num_gpu_blocks
                )
                p = self._spawn(nid, args, env)
                # CPU vLLM has no NVML: the KV cache usage is the memory signal.
                nodes[nid] = {"url": f"http://127.0.0.1:{port}", "models": [model],
                              "memory_source": "kv", "max_inflight": 64}  # fmt: skip
                _wait(lambda port=port: _http_ok(f"http://127.0.0.1:{port}/health"), 600, nid, p)
        return nodes

    def _write_nginx(self, max_body: int, sockets: list[Path], edge_table: Path) -> None:
        subs = {
            "@@RUN_DIR@@": str(self.run_dir),
            "@@LUA_DIR@@": str(self.sock_dir / "lua"),
            "@@EDGE_TABLE@@": str(edge_table),
            "@@SIDECAR_SOCKET_LIST@@": ", ".join(f'"{s}"' for s in sockets),
            "@@SIDECAR_SERVERS@@": "\n".join(
                f"    server unix:{s} max_fails=1 fail_timeout=2s;" for s in sockets
            ),
            "@@MAX_BODY@@": str(max_body),
            "@@PORT@@": str(self.port),
            "@@WORKERS@@": "2",
            "@@EXTRA_HTTP@@": self.extra_nginx_http,
            "@@LOAD_MODULES@@": "\n".join(f"load_module {m};" for m in MODULES if Path(m).exists()),
        }
        for name in ("admission_http.conf", "admission_locations.conf", "nginx.conf.template"):
            text = (NGINX_DIR / name).read_text()
            for k, v in subs.items():
                text = text.replace(k, v)
            (self.run_dir / name.replace(".template", "")).write_text(text)
        for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.run_dir / d).mkdir(exist_ok=True)

    def stop(self) -> None:
        """Stop in reverse start order (NGINX first, Redis last), each within 10 s."""
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self.procs.clear()
        if getattr(self, "sock_dir", None) is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        (self.run_dir / "nginx.pid").unlink(missing_ok=True)


def cmd_up(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    stack = Stack(Path(args.policy), run_dir, engine=args.engine, nodes=args.nodes, port=args.port,
                  sidecars=args.sidecars, redis_url=args.redis_url)  # fmt: skip
    stop = False

    def on_signal(_sig: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
        policy = load_policy(stack.runtime_policy)
        print(f"\nadmission edge ready: {stack.url}/v1  (health: {stack.url}/healthz)")
        print(f"sidecar admin: {stack.sidecar_url}/nodes   logs: {run_dir}")
        for t in policy.tenants.values():
            for k in t.demo_keys:
                print(f"  tenant {t.id:<12} classes {','.join(t.classes):<18} key {k}")
        print("Ctrl-C stops everything.\n", flush=True)
        while not stop:
            for name, proc in stack.procs:
                if proc.poll() is not None:
                    print(
                        f"{name} exited with {proc.returncode}; stopping (see {run_dir}/{name}.log)"
                    )
                    stop = True
            time.sleep(0.5)
    finally:
        stack.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """One-minute mixed overload, FIFO vs the admission stack, then the stack stays up."""
    from loadtest.bench import main as bench_main

    out = Path(args.run_dir).resolve().parent / "demo-report"
    print("demo: a one-minute mixed overload (1.5x capacity) on emulated A100 nodes, first through "
          "plain NGINX round-robin (FIFO), then through the admission stack ...", flush=True)  # fmt: skip
    bench_main(["--systems", "fifo,admission", "--nodes", str(args.nodes), "--seconds", str(args.seconds),
                "--out", str(out)])  # fmt: skip
    if args.no_serve:
        return 0
    print("\nnow serving the stack for you to try (Ctrl-C stops everything):", flush=True)
    return cmd_up(args)


def add_commands(sub: Any) -> None:
    u = sub.add_parser("up", help="run the whole stack locally in the foreground")
    u.add_argument("--policy", default=str(ROOT / "policies.yaml"))
    u.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    u.add_argument("--nodes", type=int, default=2)
    u.add_argument("--port", type=int, default=8080)
    u.add_argument("--sidecars", type=int, default=2)
    u.add_argument("--redis-url", help="use this Redis instead of starting one")
    u.add_argument("--run-dir", default=str(ROOT / "run"))
    u.set_defaults(fn=cmd_up)

    d = sub.add_parser("demo", help="benchmark FIFO vs admission for a minute, then run the stack")
    d.add_argument("--policy", default=str(ROOT / "policies.yaml"))
    d.add_argument("--engine", choices=["sim"], default="sim")
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--seconds", type=float, default=60)
    d.add_argument("--port", type=int, default=8080)
    d.add_argument("--sidecars", type=int, default=2)
    d.add_argument("--redis-url")
    d.add_argument("--run-dir", default=str(ROOT / "run"))
    d.add_argument("--no-serve", action="store_true", help="exit after the report")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser(
        "bench", help="the four-system benchmark (see loadtest/bench.py)", add_help=False
    )
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=lambda a: __import__("loadtest.bench", fromlist=["main"]).main(a.rest))
