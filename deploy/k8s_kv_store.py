"""The shared KV tier in Kubernetes: the replicas' ``--kv-store`` flags, and for trying it out
a single-instance Redis (a StatefulSet and its Service) rendered with the suite.

Owns the replica arguments and environment for the shared tier (an external Redis URL, its
password from a Secret's ``password`` key as ``TANDEM_KV_STORE_PASSWORD``, never in the
args) and the trial Redis objects. A production Redis is the cluster's own (replicated,
monitored): pass its URL. It does not own the replicas' Deployments (``k8s``).
"""

from __future__ import annotations

from typing import Any

# ``--kv-store`` value that renders the trial Redis instead of naming one.
IN_CLUSTER = "statefulset"
REDIS_PORT = 6379
REDIS_IMAGE = "redis:7.4"


def store_name(name: str) -> str:
    return f"{name}-kv-store"


def replica_args(kv_store: str | None, name: str, offload_memory: str | None) -> list[str]:
    args = ["--kv-offload-memory", offload_memory] if offload_memory else []
    if kv_store is None:
        return args
    url = (f"redis://{store_name(name)}:{REDIS_PORT}/0" if kv_store == IN_CLUSTER
           else kv_store)
    return [*args, "--kv-store", url]


def replica_env(secret: str | None) -> list[dict[str, Any]]:
    if secret is None:
        return []
    return [{"name": "TANDEM_KV_STORE_PASSWORD",
             "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}]


def trial_store(name: str, namespace: str | None, labels: dict[str, str],
                memory: str = "2Gi") -> list[dict[str, Any]]:
    """A one-pod Redis for trying the shared tier: LRU at its memory cap, nothing on disk
    (a lost pod is a cold tier, never an error: replicas recompute)."""
    metadata: dict[str, Any] = {"name": store_name(name), "labels": labels}
    if namespace:
        metadata["namespace"] = namespace
    selector = {"app.kubernetes.io/name": store_name(name)}
    container = {
        "name": "redis", "image": REDIS_IMAGE,
        "args": ["--save", "", "--appendonly", "no", "--maxmemory",
                 memory.replace("Gi", "gb").replace("Mi", "mb"),
                 "--maxmemory-policy", "allkeys-lru"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "1", "memory": memory},
                      "limits": {"memory": memory}},
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                            "runAsUser": 999, "capabilities": {"drop": ["ALL"]}},
    }
    stateful_set = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata,
        "spec": {"serviceName": store_name(name), "replicas": 1,
                 "selector": {"matchLabels": selector},
                 "template": {"metadata": {"labels": {**labels, **selector}},
                              "spec": {"containers": [container]}}},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": dict(metadata),
        "spec": {"selector": selector,
                 "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": REDIS_PORT}]},
    }
    return [service, stateful_set]
