"""`admission up`: the whole stack on 127.0.0.1 in the foreground, and its clean shutdown.

Starts, in order: redis-server (unless the policy's Redis is reachable elsewhere and
--redis-url is given), the engine nodes (emulated or vLLM), the node agent, the sidecar
processes (unix sockets; the first also on a loopback admin port), and NGINX rendered from
nginx/*.conf. Everything runs in a run directory; Ctrl-C or SIGTERM stops every process
(each in its own process group) and removes the run directory's pid and socket files.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from admission import snippets
from admission.policy import Policy, load_policy
from devstack.nodes import NodeSet
from devstack.procs import (
    Restarter,
    free_port,
    http_ok,
    kill_group,
    port_open,
    stop_process,
    wait_for,
    with_parent,
)

# Shipped inside the product package, so an installed `admission` finds them from any directory.
NGINX_DIR = Path(str(resources.files("admission") / "nginx"))
DEFAULT_POLICY = Path(str(resources.files("admission") / "policies.yaml"))
MODULES = snippets.MODULES


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
        node_max_inflight: int = 256,
        batch_workers: int = 1,
        batch_claim_idle_s: float = 30.0,
        batch_concurrency: int = 16,
    ) -> None:
        self.policy_path = policy_path
        self.run_dir = run_dir
        self.engine = engine
        self.n_nodes = nodes
        # Picked again at start() unless given: read `url` and `port` after start().
        self.fixed_port = port is not None
        self.port = port or free_port()
        self.batch_workers = batch_workers
        self.batch_claim_idle_s = batch_claim_idle_s
        self.batch_concurrency = batch_concurrency
        self.n_sidecars = sidecars
        self.profile = profile
        self.redis_url = redis_url
        self.overrides = policy_overrides or {}
        self.num_gpu_blocks = num_gpu_blocks
        self.external_nodes = external_nodes  # policy `nodes:` entries already running elsewhere
        self.extra_nginx_http = extra_nginx_http  # e.g. a benchmark's direct-proxy server block
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.specs: dict[str, tuple[list[str], dict[str, str] | None]] = {}
        self.restarter = Restarter()
        self.nodes: NodeSet | None = None
        self.node_max_inflight = node_max_inflight
        self.admin_port = free_port()
        self.runtime_policy = run_dir / "policies.yaml"
        self.admin_token = secrets.token_urlsafe(24)  # node admin over the admin port
        self.admin_token_file = run_dir / "admin.token"

    @property
    def node_ports(self) -> list[int]:
        return self.nodes.ports if self.nodes is not None else []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        self.specs[name] = (args, env)
        proc = self._popen(name)
        self.procs.append((name, proc))
        return proc

    def _popen(self, name: str) -> subprocess.Popen[bytes]:
        args, env = self.specs[name]
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=with_parent(),
            cwd=self.run_dir,
            env={**os.environ, **(env or {})},
        )
        log.close()
        self.restarter.started(name)
        return proc

    def supervise(self) -> list[str]:
        """Restart every child that died (with backoff); one line per event, for the log.

        The rest keeps serving meanwhile, with the documented failure modes: a dead sidecar's
        requests are re-asked at the other by the edge, a dead Redis is fail-open/closed per
        policy, a dead node is marked down by its agent and its fallbacks take its traffic.
        """
        events = []
        for i, (name, proc) in enumerate(self.procs):
            if proc.poll() is None:
                continue
            if self.restarter.due(name):
                kill_group(proc)
                if name.startswith("sidecar-"):
                    (self.sock_dir / f"{name}.sock").unlink(missing_ok=True)
                    (self.sock_dir / f"admit-{name.split('-')[1]}.sock").unlink(missing_ok=True)
                self.procs[i] = (name, self._popen(name))
                events.append(
                    f"{name} exited with {proc.returncode}; restarted "
                    f"(restart {self.restarter.restarts[name]})"
                )
        if self.nodes is not None:
            events += self.nodes.supervise(self.restarter)
        return events

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # NGINX workers run unprivileged and must reach the sockets and the edge table, which
        # the run directory's parents may not allow (pytest's tmp dirs are 0700).
        self.sock_dir = Path(tempfile.mkdtemp(prefix="admission-"))
        self.internal_socket = self.sock_dir / "edge-internal.sock"
        # As strict as production: the sockets and this directory are for NGINX's workers'
        # group only (0660 / 0750); started as root, the workers run as nobody:nogroup.
        self.nginx_user = "user nobody nogroup;" if os.geteuid() == 0 else ""
        self.socket_group = "nogroup" if os.geteuid() == 0 else grp.getgrgid(os.getgid()).gr_name
        os.chown(self.sock_dir, -1, grp.getgrnam(self.socket_group).gr_gid)
        self.sock_dir.chmod(0o750)
        shutil.copytree(NGINX_DIR / "lua", self.sock_dir / "lua")  # the checkout may be 0700 too
        raw = yaml.safe_load(self.policy_path.read_text())
        if self.redis_url is None:
            rport = free_port()
            p = self._spawn(
                "redis",
                [
                    "redis-server",
                    "--port",
                    str(rport),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "everysec",
                    "--dir",
                    str(self.run_dir),
                ],
            )
            self.redis_url = f"redis://127.0.0.1:{rport}/0"
            wait_for(lambda: port_open(rport), 10, "redis", p)
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
        self.admin_token_file.touch(mode=0o600)
        self.admin_token_file.write_text(self.admin_token + "\n")
        py = sys.executable
        self._spawn(
            "agent", [py, "-m", "admission.cli", "agent", "--policy", str(self.runtime_policy)]
        )
        # Picked again now that the nodes run: a real vLLM node binds loopback ports of its own
        # while it starts (a minute), and once took the admin port picked before it (the
        # sidecar then failed: "address already in use"). The edge's port likewise.
        self.admin_port = free_port()
        if not self.fixed_port:
            self.port = free_port()
        sockets = [self.sock_dir / f"sidecar-{i}.sock" for i in range(self.n_sidecars)]
        edge_table = self.sock_dir / "edge.json"
        for i, sock in enumerate(sockets):
            args = [
                py,
                "-m",
                "admission.cli",
                "serve",
                "--policy",
                str(self.runtime_policy),
                "--unix",
                str(sock),
                "--admit-unix",
                str(self.sock_dir / f"admit-{i}.sock"),
                "--socket-group",
                self.socket_group,
                "--edge-table",
                str(edge_table),
            ]
            if i == 0:
                args += [
                    "--port",
                    str(self.admin_port),
                    "--admin-token-file",
                    str(self.admin_token_file),
                ]
            p = self._spawn(f"sidecar-{i}", args)
            wait_for((self.sock_dir / f"admit-{i}.sock").exists, 30, f"sidecar {i}", p)  # the last
        self._write_nginx(policy, sockets, edge_table)
        p = self._spawn(
            "nginx", ["nginx", "-c", str(self.run_dir / "nginx.conf"), "-p", str(self.run_dir)]
        )
        wait_for(lambda: http_ok(f"{self.url}/healthz"), 30, "nginx", p)
        for i in range(self.batch_workers):  # OpenAI batches, through the internal socket
            self._spawn(
                f"batch-worker-{i}",
                [
                    py,
                    "-m",
                    "admission.cli",
                    "batch-worker",
                    "--policy",
                    str(self.runtime_policy),
                    "--edge-socket",
                    str(self.internal_socket),
                    "--claim-idle-s",
                    str(self.batch_claim_idle_s),
                    "--concurrency",
                    str(self.batch_concurrency),
                ],
            )
        for _ in range(100):  # nodes become open once the agent has sampled them
            with urllib.request.urlopen(f"{self.sidecar_url}/healthz", timeout=2) as r:
                states = json.load(r)["nodes"]
            if all(s == "open" for s in states.values()):
                break
            time.sleep(0.1)

    def _start_nodes(self) -> dict[str, Any]:
        self.nodes = NodeSet(
            self.n_nodes,
            self.run_dir,
            engine=self.engine,
            profile=self.profile,
            num_gpu_blocks=self.num_gpu_blocks,
        )
        return self.nodes.policy_nodes(max_inflight=self.node_max_inflight)

    def _write_nginx(self, policy: Policy, sockets: list[Path], edge_table: Path) -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # NGINX inherits ours
        nofile = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
        subs = {
            **snippets.placeholders(
                policy, self.sock_dir / "lua", self.sock_dir, len(sockets), edge_table
            ),
            "@@RUN_DIR@@": str(self.run_dir),
            "@@TEMP_DIR@@": str(self.sock_dir / "tmp"),
            "@@INTERNAL_SOCKET@@": str(self.internal_socket),
            "@@PORT@@": str(self.port),
            "@@USER@@": self.nginx_user,
            "@@WORKERS@@": "2",
            "@@NOFILE@@": str(nofile),
            "@@WORKER_CONNECTIONS@@": str(min(16384, nofile)),
            "@@EXTRA_HTTP@@": self.extra_nginx_http,
            "@@LOAD_MODULES@@": "\n".join(f"load_module {m};" for m in MODULES if Path(m).exists()),
        }
        for name in (*snippets.FILES, "nginx.conf.template"):
            text = snippets.fill((NGINX_DIR / name).read_text(), subs)
            (self.run_dir / name.replace(".template", "")).write_text(text)
        for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.sock_dir / "tmp" / d).mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[Stack]:
        """Started, and supervised from a background thread as `admission up` does (dead
        children restarted with backoff) until the block ends; then stopped."""
        halt = threading.Event()

        def supervise() -> None:
            while not halt.wait(0.2):
                self.supervise()

        thread = threading.Thread(target=supervise, daemon=True)
        try:
            self.start()
            thread.start()
            yield self
        finally:
            halt.set()
            if thread.is_alive():
                thread.join(5)
            self.stop()

    def stop(self) -> None:
        """Stop in reverse start order (NGINX first, Redis last), each within 10 s."""
        for _name, proc in reversed(self.procs):
            stop_process(proc)
        self.procs.clear()
        if self.nodes is not None:
            self.nodes.stop()
            self.nodes = None
        if getattr(self, "sock_dir", None) is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        (self.run_dir / "nginx.pid").unlink(missing_ok=True)
