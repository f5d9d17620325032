"""`admission k8s-manifests`: the product's Kubernetes objects, rendered from a policy.

One job: turn a policy and a few facts about the cluster (image, namespace, Redis, Prometheus)
into plain manifests and a `kustomization.yaml` listing them, so that `kubectl apply -k DIR`
deploys them and a team's own overlays can patch them. Rendered in Python rather than shipped as
a Helm chart: the edge's NGINX files and the sidecars' sockets are the same `nginx-snippets` and
`serve` flags as a host install (one story, tested once), and the policy decides what there is
to render (one vLLM Deployment and one autoscaler per served model).

What it renders (docs/operations.md, "Running on Kubernetes", walks through it):
- the edge: a Deployment of pods holding NGINX, SIDECARS sidecars and a batch worker, sharing
  the socket directory (an emptyDir); the snippets rendered at start by an init container from
  the policy (a ConfigMap); keys hashed in the policy, the admin token and the registration
  secret from the Secret `admission-secrets`; readiness from the edge's `/healthz`, liveness
  from `/livez`; a Service, a PodDisruptionBudget;
- per served model, a vLLM Deployment whose pods carry an agent registering the pod
  (`agent --register`, its id and URL from the downward API) and leaving on SIGTERM, while
  vLLM's preStop waits for its requests to end; a KEDA ScaledObject sizing it by
  `admission_model_nodes_needed`;
- Redis: the URL given, or a single StatefulSet for trials;
- monitoring: a ServiceMonitor for the sidecars' metrics and a PrometheusRule of the shipped
  alerts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from admission.kubernetes.edge import NGINX_CONF, edge
from admission.kubernetes.nodes import vllm
from admission.kubernetes.objects import LABELS, SECRETS, Cluster, meta, slug
from admission.kubernetes.support import monitoring, redis
from admission.policy import Policy


def served_models(policy: Policy) -> list[str]:
    """Every model a node serves or a tenant is allowed."""
    found = set(policy.models())
    for t in policy.tenants.values():
        found.update(t.models)
    return sorted(found)


def render(policy: Policy, policy_text: str, c: Cluster) -> dict[str, list[dict[str, Any]]]:
    """File name → the objects it holds; `kustomization.yaml` lists them all."""
    redis_url = c.redis_url or f"redis://admission-redis.{c.namespace}.svc:6379/0"
    files: dict[str, list[dict[str, Any]]] = {
        "policy.yaml": [policy_map(policy_text, redis_url, c)],
        "edge.yaml": edge(c),
        "monitoring.yaml": monitoring(c),
    }
    if c.redis_url is None:
        files["redis.yaml"] = redis(c)
    for model in c.models or served_models(policy):
        files[f"vllm-{slug(model)}.yaml"] = vllm(model, c)
    for objs in files.values():
        for o in objs:
            o["metadata"].setdefault("namespace", c.namespace)
            o["metadata"].setdefault("labels", {}).update(LABELS)
    files["kustomization.yaml"] = [
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": c.namespace,
            "resources": sorted(f for f in files if f != "kustomization.yaml"),
        }
    ]
    return files


def written_before(out: Path) -> set[str]:
    """The files an earlier render listed in `out`'s kustomization.yaml (none: none)."""
    try:
        listed = yaml.safe_load((out / "kustomization.yaml").read_text()).get("resources", [])
    except (OSError, yaml.YAMLError, AttributeError):
        return set()
    return {n for n in listed if isinstance(n, str) and "/" not in n and n.endswith(".yaml")}


def dump(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False, width=100)


def policy_map(text: str, redis_url: str, c: Cluster) -> dict[str, Any]:
    """The policy as a ConfigMap, its `redis.url` pointed at the cluster's Redis."""
    raw = yaml.safe_load(text)
    raw.setdefault("redis", {})["url"] = redis_url
    head = "# Rendered by `admission k8s-manifests`: edit the source policy and render again.\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("admission-policy"),
        "data": {
            "policies.yaml": head + yaml.safe_dump(raw, sort_keys=False, width=100),
            "nginx.conf": NGINX_CONF,
        },
    }


__all__ = ["SECRETS", "Cluster"]
