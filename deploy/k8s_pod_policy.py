"""What every Tandem pod gets in production, whatever it runs: security contexts, the writable
scratch volumes a read-only root filesystem leaves it, a PodDisruptionBudget, topology
spread, and a stop that drains.

Owns the rules, one place for all the Deployments ``k8s`` renders:

- security: the pod runs as a fixed non-root user (the image's own, numeric, so that the
  kubelet can check ``runAsNonRoot``), seccomp ``RuntimeDefault``, no service-account token
  (no Tandem process talks to the Kubernetes API: the picker finds replicas through DNS);
  every container has a read-only root filesystem, no privilege escalation and no
  capabilities at all. That is the Pod Security Standards' ``restricted`` profile.
- scratch: what a process must write goes to an ``emptyDir`` (``/tmp`` and ``HOME`` for
  Python, compilers and caches; memory-backed ``/dev/shm`` where the engine shares tensors).
- availability: at most one pod of a Deployment voluntarily disrupted at a time (a node
  drain waits for the next to be ready), replicas spread over nodes and zones as a
  preference (``ScheduleAnyway``: a cluster with fewer nodes than replicas still schedules
  them), counting only the pods of the current rollout (``matchLabelKeys``).
- stopping: a ``preStop`` sleep (the kubelet's own ``sleep`` action, Kubernetes 1.30 and
  later: no shell needed in the image) while endpoints and DNS drop the pod, then SIGTERM,
  on which each process drains; the grace period covers both plus a margin.

It does not own what runs in the pods or their ports (``k8s``).
"""

from __future__ import annotations

from typing import Any

# The Containerfile's user; the official Envoy image's ``envoy`` user.
TANDEM_UID = 10001
ENVOY_UID = 101
TMP_DIR = "/tmp"
# Past preStop and the process's own drain: the engine core stopping, the last flushes.
STOP_MARGIN_S = 15


def pod_security_context(uid: int) -> dict[str, Any]:
    """The pod's: who its processes run as (``fsGroup``: mounted volumes readable by it)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def secure_pod(pod: dict[str, Any], uid: int) -> dict[str, Any]:
    """``pod`` (a pod spec) with the security settings on it and on each of its containers,
    init containers included."""
    pod["securityContext"] = pod_security_context(uid)
    pod["automountServiceAccountToken"] = False
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        container["securityContext"] = container_security_context()
    return pod


def scratch_volume(name: str, size: str, medium: str | None = None) -> dict[str, Any]:
    """An ``emptyDir`` bounded in size: the pod is evicted past it rather than filling the
    node's disk (or, memory-backed, its memory)."""
    empty_dir: dict[str, Any] = {"sizeLimit": size}
    if medium:
        empty_dir["medium"] = medium
    return {"name": name, "emptyDir": empty_dir}


def tmp_volume() -> dict[str, Any]:
    return scratch_volume("tmp", "2Gi")


def tmp_mount() -> dict[str, Any]:
    return {"name": "tmp", "mountPath": TMP_DIR}


def tmp_env() -> list[dict[str, Any]]:
    """HOME and TMPDIR in the scratch volume: ``~/.cache`` (Hugging Face, Triton, torch's
    inductor) and temporary files land somewhere writable."""
    return [{"name": "HOME", "value": TMP_DIR}, {"name": "TMPDIR", "value": TMP_DIR}]


def pre_stop_sleep(seconds: int) -> dict[str, Any]:
    """A container's ``lifecycle``: wait ``seconds`` before SIGTERM."""
    return {"preStop": {"sleep": {"seconds": seconds}}}


def termination_grace_s(pre_stop_s: int, drain_s: float) -> int:
    """Seconds between the kubelet starting to stop a pod and SIGKILL: the preStop sleep, the
    process's drain after SIGTERM, and the margin."""
    return int(pre_stop_s + drain_s + 0.999) + STOP_MARGIN_S


def topology_spread(labels: dict[str, str]) -> list[dict[str, Any]]:
    """Spread a Deployment's pods over nodes, then zones, as a preference."""
    return [{
        "maxSkew": 1,
        "topologyKey": key,
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": dict(labels)},
        "matchLabelKeys": ["pod-template-hash"],
    } for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")]


def disruption_budget(metadata: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """At most one of the pods ``labels`` select voluntarily disrupted at a time; an unhealthy
    pod may always be evicted (it serves nothing, and would otherwise block a node drain)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": dict(labels)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
