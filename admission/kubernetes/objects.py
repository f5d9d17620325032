"""What every rendered object shares: the cluster's facts the policy does not hold (`Cluster`),
names and labels, and the container that runs the `admission` command with the policy mounted."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from admission.snippets import ADMIN_PORT, SOCKET_DIR

SIDECARS = 2  # two per pod: the edge asks the other while one restarts
EDGE_PORT = 8080  # NGINX's, unprivileged
VLLM_PORT = 8000
REDIS_IMAGE = "redis:7.2.7-bookworm"
VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"  # the version pyproject's `vllm` extra pins
SECRETS = "admission-secrets"  # keys: admin-token (required), discovery-secret
LABELS = {"app.kubernetes.io/part-of": "admission"}
SNIPPETS_DIR = "/etc/nginx/admission"
ADMIN_TOKEN = "/etc/admission/secrets/admin-token"


@dataclass(frozen=True)
class Cluster:
    """What the policy does not say about the cluster."""

    image: str
    namespace: str = "admission"
    redis_url: str | None = None  # None: a trial StatefulSet
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    edge_replicas: int = 2
    max_nodes: int = 8  # per model, the autoscaler's ceiling
    grace_s: int = 120  # a leaving node's requests get this long
    models: tuple[str, ...] = ()  # a vLLM Deployment each (default: the policy's served models)


def slug(name: str) -> str:
    """A model name as a Kubernetes object name (RFC 1123: lower case, digits, '-')."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s[:40].strip("-") or "model"


def meta(name: str, **labels: str) -> dict[str, Any]:
    return {"name": name, "labels": dict(labels)} if labels else {"name": name}


def secret_env(name: str, key: str) -> dict[str, Any]:
    ref = {"name": SECRETS, "key": key, "optional": True}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def admission(name: str, args: list[str], c: Cluster, **extra: Any) -> dict[str, Any]:
    """A container running the `admission` command of the image, the policy mounted."""
    mounts = [{"name": "policy", "mountPath": "/etc/admission/policy", "readOnly": True}]
    return {
        "name": name,
        "image": c.image,
        "command": ["admission", *args],
        "env": [
            {"name": "ADMISSION_POLICY", "value": "/etc/admission/policy/policies.yaml"},
            secret_env("ADMISSION_DISCOVERY_SECRET", "discovery-secret"),
        ],
        "volumeMounts": mounts + extra.pop("mounts", []),
        **extra,
    }


__all__ = ["ADMIN_PORT", "SOCKET_DIR"]
