"""``tandem render k8s`` with the KV tiers: the replicas get the tier flags, the shared
store's password comes from a Secret (never an argument), and ``--kv-store statefulset``
renders a one-pod Redis that the replicas' URL names; every object passes the strict
Kubernetes schemas."""

from __future__ import annotations

from deploy.k8s import K8sOptions, render_k8s_manifests
from tests.k8s_schemas import validate_object


def _replica_containers(objects: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    return [c for o in objects if o["kind"] == "Deployment"
            and o["metadata"]["labels"].get("app.kubernetes.io/component") == "replica"
            for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "replica"]


def test_external_store_with_a_password_secret() -> None:
    objects = render_k8s_manifests(K8sOptions(
        kv_offload_memory="4GiB", kv_store="rediss://redis.example.internal:6380/2",
        kv_store_secret="kv-store-auth"))
    containers = _replica_containers(objects)
    assert len(containers) == 2  # prefill and decode
    for container in containers:
        args = container["args"]
        assert args[args.index("--kv-store") + 1] == "rediss://redis.example.internal:6380/2"
        assert args[args.index("--kv-offload-memory") + 1] == "4GiB"
        assert not any("password" in a.lower() for a in args)
        env = {e["name"]: e for e in container["env"]}
        assert env["TANDEM_KV_STORE_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "kv-store-auth", "key": "password"}
    assert not any(o["kind"] == "StatefulSet" for o in objects)
    for obj in objects:
        validate_object(obj)


def test_trial_statefulset_is_rendered_and_named_by_the_replicas() -> None:
    objects = render_k8s_manifests(K8sOptions(kv_store="statefulset"))
    stateful = [o for o in objects if o["kind"] == "StatefulSet"]
    assert len(stateful) == 1 and stateful[0]["spec"]["replicas"] == 1
    service = next(o for o in objects if o["kind"] == "Service"
                   and o["metadata"]["name"] == "tandem-kv-store")
    pod_labels = stateful[0]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    for container in _replica_containers(objects):
        args = container["args"]
        assert args[args.index("--kv-store") + 1] == "redis://tandem-kv-store:6379/0"
    for obj in objects:
        validate_object(obj)
