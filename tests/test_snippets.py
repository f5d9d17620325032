"""The SRE's path, end to end (issue 63), as docs/operations.md's "Adding the edge to your NGINX"
says: `admission admin-token`, `admission nginx-snippets` renders the files and prints the
processes to run; a stock Debian-style nginx.conf (`user www-data;`, its own access log,
`location /` and a `/healthz` of its own) includes them; the two sidecars and the agent run
from the printed commands (sockets of group www-data in a 0750 directory); then the operator's
day: the SDK through it, embeddings admitted and charged, another /v1/ path passed after the
key check, one of two sidecars killed, the only node drained, the agent killed."""

from __future__ import annotations

import grp
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from devstack.nodes import NodeSet
from devstack.probes import refunded
from devstack.procs import RedisServer, free_port, port_open, stop_process, wait_for
from devstack.stack import DEFAULT_POLICY

pytestmark = pytest.mark.timeout(240)

STOCK = """user www-data;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
include {out}/admission_modules.conf;

events {{
    worker_connections 768;
}}

http {{
    sendfile on;
    tcp_nopush on;
    types_hash_max_size 2048;
    default_type application/octet-stream;
    access_log {d}/access.log;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;

    include {out}/admission_http.conf;
    include {out}/admission_internal.conf;

    server {{
        listen 127.0.0.1:{port};
        location / {{
            return 200 "the site's own page\\n";
        }}
        location /healthz {{
            return 200 "the site's own health check\\n";
        }}
        include {out}/admission_locations.conf;
    }}
}}
"""


class Upstream(BaseHTTPRequestHandler):
    """A service of the SRE's own behind edge.passthrough: echoes what reached it."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        doc = {
            "path": self.path,
            "tenant": self.headers.get("X-Admission-Tenant"),
            "authorization": self.headers.get("Authorization"),
            "body": body.decode(),
        }
        out = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *_args: Any) -> None:
        pass


@dataclass
class Edge:
    url: str
    work: Path
    run: Path
    token: Path
    commands: list[list[str]]
    admin_urls: list[str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str]) -> None:
        with open(self.work / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=log, cwd=self.work)

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text()


def printed_commands(stdout: str, admission: str) -> list[list[str]]:
    """The `serve` and `agent` commands nginx-snippets printed, each as argv."""
    return [shlex.split(line) for line in stdout.splitlines() if line.strip().startswith(admission)]


@pytest.fixture(scope="module")
def edge(redis_server: RedisServer) -> Iterator[Edge]:
    if os.geteuid() != 0:
        pytest.skip("runs NGINX as `user www-data;`, which needs root")
    work = Path(tempfile.mkdtemp(prefix="sre-"))
    work.chmod(0o755)  # NGINX's workers (www-data) read the rendered files and Lua modules
    run = work / "run" / "admission"  # the units' /run/admission; `serve` creates it
    nodes = NodeSet(1, work)
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    admission = str(Path(sys.executable).with_name("admission"))
    e = Edge("", work, run, work / "admin.token", [], [])
    try:
        raw = yaml.safe_load(DEFAULT_POLICY.read_text())
        raw["redis"]["url"] = redis_server.url
        raw["nodes"] = nodes.policy_nodes(max_inflight=8)
        raw["edge"]["admit_embeddings"] = True
        raw["edge"]["passthrough"] = {"/v1/responses": f"http://127.0.0.1:{upstream.server_port}"}
        policy = work / "policies.yaml"
        policy.write_text(yaml.safe_dump(raw, sort_keys=False))
        subprocess.run([admission, "admin-token", str(e.token)], check=True, capture_output=True)
        out = work / "nginx-admission"
        rendered = subprocess.run(
            [
                *(admission, "nginx-snippets", "--out", str(out), "--policy", str(policy)),
                *("--socket-dir", str(run), "--group", "www-data"),
                *("--admin-token-file", str(e.token)),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=work,
        )
        assert "user www-data" in rendered.stdout
        for path in (out / "admission_http.conf", out / "admission_locations.conf"):
            assert not re.search(r"@@[A-Z_]+@@", path.read_text()), path
        e.commands = printed_commands(rendered.stdout, admission)
        assert [c[1] for c in e.commands] == ["serve", "serve", "agent"]  # two sidecars, an agent
        for c in e.commands[:2]:  # the admin ports the units use (9100 + N): free ones here
            port = free_port()
            c[c.index("--port") + 1] = str(port)
            e.admin_urls.append(f"http://127.0.0.1:{port}")
        for d in ("body", "proxy"):
            (work / d).mkdir()
        for i, c in enumerate(e.commands[:2]):
            e.start(f"sidecar-{i}", c)
        for i in range(2):
            wait_for((run / f"admit-{i}.sock").exists, 30, "sidecar", e.procs[f"sidecar-{i}"])
        assert (run.stat().st_mode & 0o777) == 0o750  # created by `serve`, for its group
        assert run.stat().st_gid == grp.getgrnam("www-data").gr_gid
        e.start("agent", e.commands[2])
        port = free_port()
        conf = work / "nginx.conf"
        conf.write_text(STOCK.format(d=work, out=out, port=port))
        test = subprocess.run(
            ["nginx", "-t", "-c", str(conf), "-p", str(work)], capture_output=True, text=True
        )
        assert test.returncode == 0, test.stderr
        e.start("nginx", ["nginx", "-g", "daemon off;", "-c", str(conf), "-p", str(work)])
        wait_for(lambda: port_open(port), 10, "nginx", e.procs["nginx"])
        e.url = f"http://127.0.0.1:{port}"
        wait_for(lambda: call(e, "/healthz")[0] == 200, 20, "edge ready", e.procs["nginx"])
        yield e
    finally:
        for p in reversed(list(e.procs.values())):
            stop_process(p)
        upstream.shutdown()
        upstream.server_close()
        nodes.stop()
        shutil.rmtree(work, ignore_errors=True)


def call(
    e: Edge, path: str, body: Any = None, key: str | None = "sk-demo-acme"
) -> tuple[int, Any, Any]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(e.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            status, h = r.status, r.headers
    except urllib.error.HTTPError as err:
        with err:
            text = err.read().decode()
            status, h = err.code, err.headers
    try:
        return status, h, json.loads(text)
    except ValueError:
        return status, h, text


def chat(e: Edge) -> tuple[int, Any, Any]:
    body = {"model": "llama-3-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return call(e, "/v1/chat/completions", body)


def test_an_sdk_request_through_an_nginx_of_ones_own(edge: Edge) -> None:
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key="sk-demo-acme", max_retries=3) as c:
        answer = c.chat.completions.with_raw_response.create(
            model="llama-3-8b", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert answer.parse().choices[0].message.content
    assert answer.headers["x-ratelimit-limit-requests"]
    # The access log of one's own http {} counts the request once: the edge's relay server
    # logs nothing of its own (it doubled log-based counts and bills).
    time.sleep(0.3)
    logged = (edge.work / "access.log").read_text()
    assert logged.count("/v1/chat/completions") == 1, logged
    with (
        openai.OpenAI(base_url=f"{edge.url}/v1", api_key="sk-nope", max_retries=0) as c,
        pytest.raises(openai.AuthenticationError),
    ):
        c.models.list()
    # The site's own paths are its own; /healthz is the edge's readiness, in JSON.
    assert call(edge, "/", key=None)[::2] == (200, "the site's own page\n")
    assert call(edge, "/healthz", key=None)[::2] == (200, {"status": "ok"})


def test_embeddings_are_admitted_and_charged_what_the_engine_counted(edge: Edge) -> None:
    text = "x" * 400
    before = refunded(edge.run, "acme")
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key="sk-demo-acme", max_retries=0) as c:
        answer = c.embeddings.with_raw_response.create(model="llama-3-8b", input=text)
    got = answer.parse()
    assert len(got.data) == 1 and got.data[0].embedding
    assert answer.headers["x-ratelimit-limit-tokens"]  # admitted under the tenant's limits
    # Booked: the edge's estimate (400 characters / edge.chars_per_token 4, + 1) and one output
    # token; settled to the engine's count, the rest refunded.
    booked = 400 // 4 + 1 + 1
    wait_for(lambda: refunded(edge.run, "acme") > before, 10, "the release")
    assert refunded(edge.run, "acme") - before == booked - got.usage.prompt_tokens
    # No key, no embeddings: the key check is the same as for chat.
    assert call(edge, "/v1/embeddings", {"model": "llama-3-8b", "input": "hi"}, key=None)[0] == 401


def test_other_v1_paths_pass_after_the_key_check_or_are_404(edge: Edge) -> None:
    status, _h, doc = call(edge, "/v1/responses", {"input": "hi"})
    assert status == 200, doc
    # The tenant named, its key kept from the upstream, the path and body as sent.
    assert doc == {
        "path": "/v1/responses",
        "tenant": "acme",
        "authorization": None,
        "body": '{"input": "hi"}',
    }
    assert call(edge, "/v1/responses", {"input": "hi"}, key="sk-nope")[0] == 401
    status, _h, doc = call(edge, "/v1/audio/speech", {"input": "hi"})
    assert status == 404 and doc["error"]["code"] == "unknown_url", doc
    assert "/v1/embeddings, /v1/models, /v1/responses" in doc["error"]["message"]


def test_one_of_two_sidecars_killed_requests_keep_succeeding(edge: Edge) -> None:
    edge.procs["sidecar-0"].send_signal(signal.SIGKILL)
    edge.procs["sidecar-0"].wait(timeout=10)
    try:
        assert [chat(edge)[0] for _ in range(40)] == [200] * 40
        # The dead sidecar is skipped with a backoff, and said once per interval with a count:
        # a few of NGINX's own connect() lines, not one per request (40 here).
        lines = [
            line
            for line in (edge.work / "error.log").read_text().splitlines()
            if "admit-0.sock" in line or "sidecar-0.sock" in line
        ]
        assert 1 <= len(lines) <= 16, "\n".join(lines)
        assert any("is that sidecar running?" in line for line in lines), lines
    finally:
        edge.start("sidecar-0", edge.commands[0])
        wait_for(lambda: port_open(int(edge.admin_urls[0].rsplit(":", 1)[1])), 30, "sidecar-0")


def node(edge: Edge, action: str) -> None:
    r = subprocess.run(
        [
            *(edge.commands[2][0], "node", action, "node-0"),
            *("--sidecar", edge.admin_urls[1], "--token-file", str(edge.token)),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def no_capacity(edge: Edge) -> None:
    status, headers, body = chat(edge)
    assert status == 503 and body["error"]["code"] == "no_capacity", (status, body)
    assert int(headers["Retry-After"]) >= 10
    assert int(headers["x-ratelimit-remaining-requests"]) > 0  # not rate limited
    assert call(edge, "/healthz", key=None)[::2] == (503, {"status": "no_capacity"})


def test_the_only_node_drained_is_503_no_capacity_not_429(edge: Edge) -> None:
    node(edge, "drain")
    try:
        time.sleep(0.6)  # both sidecars' next refresh sees the flag
        no_capacity(edge)
    finally:
        node(edge, "undrain")
    time.sleep(0.6)
    assert chat(edge)[0] == 200


def test_the_agent_killed_is_503_no_capacity_logged_and_not_ready(edge: Edge) -> None:
    edge.procs["agent"].send_signal(signal.SIGKILL)
    edge.procs["agent"].wait(timeout=10)
    time.sleep(4.0)  # watermarks.stale_after_s (3 s) after its last word, the node is down
    no_capacity(edge)
    assert re.search(r"node node-0: open → down", edge.log("sidecar-1")), edge.log("sidecar-1")
    assert call(edge, "/livez", key=None)[::2] == (200, {"status": "alive"})
