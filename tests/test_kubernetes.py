"""`admission k8s-manifests` (issue 65): the rendered objects validate against the Kubernetes API
schemas (kubernetes-validate, pinned), the custom resources hold together (the ServiceMonitor
finds the Service's ports, the PrometheusRule and KEDA's query pass promtool, the autoscaler
targets a rendered Deployment), and the pods run as rendered: the edge pod's init container and
containers, and a vLLM pod's agent, started from the manifests' own commands and environment
(paths of the volumes mapped into a scratch directory), serve a request through NGINX, and the
agent's SIGTERM takes its node out."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from admission.kubernetes import objects as k8s
from devstack.nodes import NodeSet
from devstack.procs import RedisServer, free_port, port_open, stop_process, wait_for
from devstack.stack import DEFAULT_POLICY

pytestmark = pytest.mark.timeout(240)
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CUSTOM = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "Kustomization"}


def render(tmp: Path, policy: dict[str, Any], *flags: str) -> dict[str, list[dict[str, Any]]]:
    """Run the command as a user does; the objects of every file it wrote."""
    src = tmp / "policies.yaml"
    src.write_text(yaml.safe_dump(policy, sort_keys=False))
    out = tmp / "manifests"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "admission.cli", "k8s-manifests", "--out", str(out)),
            *("--policy", str(src), "--image", "registry.example/admission:0.1.0", *flags),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kubectl apply -k" in done.stdout
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(out.glob("*.yaml"))}


def shipped(**discovery: Any) -> dict[str, Any]:
    raw = yaml.safe_load(DEFAULT_POLICY.read_text())
    raw["discovery"] = {"enabled": True, "allow": ["127.0.0.0/8"], "secret_file": "/nope"}
    raw["discovery"].update(discovery)
    return dict(raw)


def by_kind(files: dict[str, list[dict[str, Any]]], kind: str) -> list[dict[str, Any]]:
    return [o for objs in files.values() for o in objs if o["kind"] == kind]


def test_the_manifests_validate_against_the_kubernetes_schemas(tmp_path: Path) -> None:
    files = render(tmp_path, shipped())
    assert set(files) == {
        "kustomization.yaml",
        "policy.yaml",
        "edge.yaml",
        "monitoring.yaml",
        "redis.yaml",  # no --redis-url: the trial StatefulSet
        "vllm-llama-3-8b.yaml",
    }
    listed = files["kustomization.yaml"][0]["resources"]
    assert sorted(listed) == sorted(f for f in files if f != "kustomization.yaml")
    builtin = [o for objs in files.values() for o in objs if o["kind"] not in CUSTOM]
    assert {o["kind"] for o in builtin} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ConfigMap",
        "StatefulSet",
    }
    for version in K8S_VERSIONS:
        for obj in builtin:
            kubernetes_validate.validate(obj, version, strict=True)
    # The validator can fail: a misspelt field and a wrong type are refused.
    bad = copy.deepcopy(by_kind(files, "Deployment")[0])
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = copy.deepcopy(by_kind(files, "Deployment")[0])
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    # An existing Redis: no StatefulSet, the policy pointed at it.
    files = render(tmp_path, shipped(), "--redis-url", "redis://redis.infra:6379/2")
    assert "redis.yaml" not in files  # the earlier render's file, removed
    text = by_kind(files, "ConfigMap")[0]["data"]["policies.yaml"]
    assert yaml.safe_load(text)["redis"]["url"] == "redis://redis.infra:6379/2"


def test_the_custom_resources_hold_together(tmp_path: Path) -> None:
    files = render(tmp_path, shipped())
    service = next(
        o for o in by_kind(files, "Service") if o["metadata"]["name"] == "admission-edge"
    )
    monitor = by_kind(files, "ServiceMonitor")[0]
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    edge = by_kind(files, "Deployment")[0]["spec"]["template"]["spec"]
    served = {p["containerPort"] for c in edge["containers"] for p in c.get("ports", [])}
    for ep in monitor["spec"]["endpoints"]:
        assert ports[ep["port"]] in served, ep
    # The shipped alerts as a PrometheusRule, and KEDA's query, pass promtool.
    groups = by_kind(files, "PrometheusRule")[0]["spec"]["groups"]
    assert any(r.get("alert") == "AdmissionDemandAboveSupply" for g in groups for r in g["rules"])
    scaled = by_kind(files, "ScaledObject")
    assert [s["spec"]["scaleTargetRef"]["name"] for s in scaled] == ["vllm-llama-3-8b"]
    assert "vllm-llama-3-8b" in {d["metadata"]["name"] for d in by_kind(files, "Deployment")}
    query = scaled[0]["spec"]["triggers"][0]["metadata"]["query"]
    assert "admission_model_nodes_needed" in query
    rules = {"groups": [*groups, {"name": "keda", "rules": [{"record": "keda:q", "expr": query}]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    check = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Secrets stay out of the manifests: the policy's keys are digests, the token a reference.
    text = "".join(yaml.safe_dump_all(objs) for objs in files.values())
    assert "sk-demo" not in text.replace("plain:sk-demo", "")  # the shipped demo keys only


def test_the_dockerfile_builds_from_what_the_checkout_holds() -> None:
    """No docker here: the image's recipe copies what exists and installs the NGINX packages
    the project's own setup installs."""
    root = Path(__file__).resolve().parent.parent
    text = (root / "deploy" / "Dockerfile").read_text()
    copied = [
        w for line in text.splitlines() if line.startswith("COPY ") for w in line.split()[1:-1]
    ]
    assert copied and all((root / c).exists() for c in copied), copied
    setup = (root / "scripts" / "setup.sh").read_text()
    for package in ("nginx-light", "libnginx-mod-http-lua", "lua-cjson"):
        assert package in text and package in setup, package
    assert "USER 10001" in text  # the pods' runAsUser
    assert "runAsUser: 10001" in (k8s_edge := yaml.safe_dump(edge_pod()))
    assert "runAsNonRoot: true" in k8s_edge


def edge_pod() -> dict[str, Any]:
    from admission.kubernetes.edge import edge
    from admission.kubernetes.objects import Cluster

    return dict(edge(Cluster(image="i"))[0]["spec"]["template"]["spec"])


# The pods as rendered, run here: every path a volume mounts, mapped into a scratch directory.


class Pod:
    def __init__(self, work: Path, mounts: dict[str, Path], ports: dict[int, int]) -> None:
        self.work, self.mounts, self.ports = work, mounts, ports
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def map(self, text: str) -> str:
        for inside, here in sorted(self.mounts.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(inside, str(here))
        for inside_port, here_port in self.ports.items():
            text = re.sub(rf"(?<![0-9]){inside_port}(?![0-9])", str(here_port), text)
        return text

    def env(self, c: dict[str, Any], fields: dict[str, str], secrets: Path) -> dict[str, str]:
        env = dict(os.environ)
        for e in c.get("env", []):
            src = e.get("valueFrom", {})
            if "fieldRef" in src:
                env[e["name"]] = fields[src["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in src:
                f = secrets / src["secretKeyRef"]["key"]
                if f.exists():
                    env[e["name"]] = f.read_text().strip()
            else:  # $(VAR) expands as the kubelet does
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), ""), e["value"])
                env[e["name"]] = self.map(value)
        return env

    def start(self, c: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[bytes]:
        argv = [self.map(a) for a in c["command"] + c.get("args", [])]
        if argv[0] == "admission":
            argv[0] = str(Path(sys.executable).with_name("admission"))
        with open(self.work / f"{c['name']}.log", "ab") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=self.work)
        self.procs[c["name"]] = p
        return p


def call(url: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-demo-acme"}
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None, headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(f"/tmp/k8s-pod-{os.getpid()}")  # short: unix socket paths have a 108-byte limit
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_pods_run_as_rendered(redis_server: RedisServer, work: Path) -> None:
    nodes = NodeSet(1, work)
    policy = shipped(secret_file="/etc/admission/secrets/discovery-secret")
    policy["nodes"] = {}  # every node registers itself
    files = render(work, policy, "--redis-url", redis_server.url, "--model", "llama-3-8b")
    secrets = work / "secrets"
    secrets.mkdir()
    (secrets / "admin-token").write_text("t" * 32 + "\n")
    (secrets / "discovery-secret").write_text("k8s-test-discovery-secret-0123\n")
    config = work / "policy"
    config.mkdir()
    for name, text in by_kind(files, "ConfigMap")[0]["data"].items():
        (config / name).write_text(text)
    nginx_conf = config / "nginx.conf"
    edge_port = free_port()
    mounts = {
        "/etc/admission/policy": config,
        "/etc/admission/secrets": secrets,
        "/run/admission": work / "run",
        "/etc/nginx/admission": work / "snippets",
        "/tmp/nginx": work / "nginx",
        "0.0.0.0": Path("127.0.0.1"),  # loopback only, here
    }
    for empty_dir in ("nginx", "run", "snippets"):  # a pod's emptyDirs exist from its start
        (work / empty_dir).mkdir()
    pod = Pod(work, mounts, {8080: edge_port, 8000: nodes.ports[0]} | _admin_ports())
    conf = pod.map(nginx_conf.read_text()).replace(
        f"listen {edge_port}", f"listen 127.0.0.1:{edge_port}"
    )
    # The pod runs every container as one user. As root here, NGINX's workers stay root too (by
    # default they would drop to nobody); as anyone else they run as the test's user anyway.
    nginx_conf.write_text(("user root;\n" if os.geteuid() == 0 else "") + conf)
    fields = {"metadata.name": "vllm-llama-3-8b-7d9f-x2", "status.podIP": "127.0.0.1"}
    edge = by_kind(files, "Deployment")[0]["spec"]["template"]["spec"]
    vllm = by_kind(files, "Deployment")[1]["spec"]["template"]["spec"]
    try:
        init = pod.start(edge["initContainers"][0], pod.env(edge["initContainers"][0], {}, secrets))
        assert init.wait(60) == 0, (work / "snippets.log").read_text()
        for c in edge["containers"]:
            pod.start(c, pod.env(c, fields, secrets))
        wait_for(lambda: port_open(edge_port), 20, "nginx", pod.procs["nginx"])
        url = f"http://127.0.0.1:{edge_port}"
        assert call(url + "/livez") == (200, {"status": "alive"})
        assert call(url + "/healthz")[0] == 503  # no node registered yet
        agent = next(c for c in vllm["containers"] if c["name"] == "agent")
        pod.start(agent, pod.env(agent, fields, secrets))
        wait_for(lambda: call(url + "/healthz")[0] == 200, 30, "a node", pod.procs["agent"])
        body = {
            "model": "llama-3-8b",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        }
        # Both sidecars read the registry, and NGINX's model list their table, within a second:
        # until then a request may meet one that does not know the model yet (404).
        # Five in a row: each sidecar and each NGINX worker has it.
        served = lambda: all(call(url + "/v1/chat/completions", body)[0] == 200 for _ in range(5))  # noqa: E731
        wait_for(served, 20, "the model")
        time.sleep(2.5)  # past a sidecar's registry poll (1 s) and NGINX's table poll (1 s)
        status, answer = call(url + "/v1/chat/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"]
        # The pod's termination: the agent drains, deregisters, and the edge says so.
        pod.procs["agent"].send_signal(signal.SIGTERM)
        assert pod.procs["agent"].wait(60) == 0, (work / "agent.log").read_text()
        wait_for(lambda: call(url + "/healthz")[0] == 503, 20, "the node gone", None)
        # vLLM's preStop returns once its node is idle.
        vllm_c = next(c for c in vllm["containers"] if c["name"] == "vllm")
        wait = vllm_c["lifecycle"]["preStop"]["exec"]["command"]
        done = subprocess.run([sys.executable, *wait[1:-1], pod.map(wait[-1])], timeout=30)
        assert done.returncode == 0
    finally:
        for p in reversed(list(pod.procs.values())):
            stop_process(p)
        nodes.stop()
        for log in sorted(work.glob("*.log")):  # shown when the test fails
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")


def _admin_ports() -> dict[int, int]:
    return {k8s.ADMIN_PORT + i: free_port() for i in range(k8s.SIDECARS)}
