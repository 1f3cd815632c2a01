"""Tandem's Kubernetes manifests, rendered as plain dicts (one per object).

Owns what a cluster runs and how the pieces find each other:

- replicas: one Deployment per role (``prefill``, ``decode``, and ``both`` when asked for),
  each behind a headless Service (the endpoint picker resolves its pod IPs), with gRPC health
  probes, resources, the model volume and the engine id taken from the pod name; every
  replica advertises its pod IP (downward API) as its KV address, and a prefill replica
  listens for KV pulls on a fixed port (``REPLICA_KV_PORT``);
- the endpoint picker (``tandem picker``): a Deployment and a Service, the
  ``ext_proc`` server that both the InferencePool and Tandem's own Envoy ask where a request
  goes. Two replicas by default, active-active: each watches every replica's KV events and
  load itself, so each holds the whole prefix index; what they do not share is the few
  seconds of "just routed here" guesses (``PrefixIndex.expect``) and their own in-flight
  counts, which costs at most some prefix hits while two pickers route the same new prefix
  at once (docs/kubernetes.md);
- Envoy, Tandem's OpenAI-compatible HTTP front: a ConfigMap holding the bootstrap
  (``envoy_config.render_picker_bootstrap``, descriptor inlined), a Deployment running the
  official Envoy image on it and a Service, with TLS on a second port when a Secret is named
  and API keys from a Secret (added to the bootstrap by an init container) when one is named;
- with ``lora_syncer``, a ConfigMap naming the LoRA adapters to serve and a sidecar in every
  replica pod (``tandem lora sync``) that loads and unloads them as the ConfigMap changes;
- an ``InferencePool`` (``inference.networking.k8s.io/v1``) of the decode-capable replicas,
  their gRPC port over h2c and the endpoint picker as its ``endpointPickerRef``, and an
  ``HTTPRoute`` (``gateway.networking.k8s.io/v1``) on an existing Gateway: OpenAI HTTP paths
  go to Envoy; gRPC calls of ``tandem.v1.Generation`` go to the InferencePool, or to Envoy
  as well when API keys are required (the Gateway's own path to the pool checks none);
- a PodDisruptionBudget per Deployment; security contexts, scratch volumes, topology spread
  and draining stops from ``k8s_pod_policy``.

It does not own writing files (``render``), the pod policy's rules (``k8s_pod_policy``) or the
Gateway itself (a cluster's own, named by ``gateway_name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy import k8s_kv_store as kv_store
from deploy import k8s_pod_policy as policy
from deploy.envoy_config import (
    DEFAULT_DESCRIPTOR,
    TlsFiles,
    render_picker_bootstrap,
)
from deploy.lora_sync import render_config
from deploy.yaml_text import dump_yaml
from engine_common.config import ModelSettings
from gateway.tier_weights import format_tier_weights
from services.model_settings import model_settings_args

# What ``make image`` tags (the Makefile's IMAGE; tests/test_k8s_manifests.py checks).
DEFAULT_IMAGE = "localhost/tandem:0.1.0"
# The default model, converted to safetensors when the image was built (Containerfile).
IMAGE_DEFAULT_MODEL = "/opt/tandem/cache/models/SmolLM2-135M-Instruct"
REPLICA_PORT = 50051
REPLICA_METRICS_PORT = 9400
REPLICA_KV_PORT = 50052  # a prefill replica's UCX listener (KV pulls by decode replicas)
# grpc.health.v1 only, in plaintext, for the kubelet's probes (the gRPC port wants the suite's
# certificate, which a probe cannot present).
REPLICA_HEALTH_PORT = 50053
PICKER_PORT = 9002
PICKER_METRICS_PORT = 9090
ENVOY_HTTP_PORT = 8080
ENVOY_HTTPS_PORT = 8443
ENVOY_ADMIN_PORT = 9901  # on the pod's loopback only
ENVOY_CONFIG_DIR = "/etc/envoy"
ENVOY_TEMPLATE_DIR = "/etc/envoy-template"
API_KEYS_DIR = "/etc/tandem-api-keys"
API_KEYS_ENTRY = "api-keys"
TLS_DIR = "/etc/tandem/tls"
SUITE_TLS_DIR = "/etc/tandem/suite-tls"  # the suite's certificate (services.suite_tls)
# Writable (an emptyDir): the CPU attention kernel each node builds for its own CPU, and the
# default model's conversion when an image does not carry it.
CACHE_DIR = "/var/cache/tandem"
LORA_CONFIG_DIR = "/etc/tandem/lora"
LORA_CONFIG_ENTRY = "configmap.yaml"  # the inference extension's LoRA syncer's file name
ROLE_LABEL = "tandem.dev/role"
POOL_LABEL = "tandem.dev/inference-pool"
INFERENCE_GROUP = "inference.networking.k8s.io"
ROLES = ("prefill", "decode", "both")
DECODE_CAPABLE = ("decode", "both")
# Before SIGTERM, the kubelet waits this long for Services, EndpointSlices and the picker's
# DNS view to drop the stopping pod, so that new requests go elsewhere.
PRE_STOP_S = 5


@dataclass(frozen=True)
class K8sOptions:
    image: str = DEFAULT_IMAGE
    # The model directory inside the containers; None: the default model the image carries.
    model: str | None = None
    name: str = "tandem"
    namespace: str | None = None
    prefill: int = 1
    decode: int = 1
    both: int = 0
    # A PersistentVolumeClaim holding the model, mounted read-only at model_mount.
    model_pvc: str | None = None
    model_mount: str = "/models"
    # The names clients call the model by (the replicas' --served-model-name, as vLLM's: the
    # first names it in answers and metrics); empty: the model directory's name. The picker
    # needs none: it tells a LoRA adapter's requests by the adapter's name, any other is base.
    served_model_names: tuple[str, ...] = ()
    # The replicas' chat template (a file in the containers, or the Jinja text), tool-call
    # syntax and sampling defaults (``tandem serve --help``); the endpoint picker renders
    # chats with the same template to route them.
    model_settings: ModelSettings = field(default_factory=ModelSettings)
    replica_cpu: str = "4"
    replica_memory: str = "16Gi"
    # CPU limit = request (a whole number): Guaranteed QoS, so that a kubelet with the static
    # CPU manager gives each CPU replica cores of its own, and a decode replica keeps one of
    # them for its frontend (``--engine-cpus auto``).
    exclusive_cpus: bool = False
    gpus: int = 0  # per replica; 0 runs on CPU
    # Tensor-parallel ranks per replica (``tandem serve --tensor-parallel-size``); prefill
    # replicas may differ from decode ones (P/D across parallel sizes). A TP replica gets
    # ``nvidia.com/gpu: N``, or N times ``replica_cpu`` and ``replica_memory`` (each rank is
    # an engine process with its own KV budget), and a /dev/shm of a GiB per rank.
    tensor_parallel_size: int = 1
    prefill_tensor_parallel_size: int | None = None  # None: ``tensor_parallel_size``
    kv_cache_memory: str = "2GiB"  # CPU KV cache; on GPU the engine sizes its own
    envoy_image: str = "envoyproxy/envoy:v1.40.0"
    envoy_replicas: int = 1
    # Active-active, each with the whole prefix index (see the module docstring).
    picker_replicas: int = 2
    # Seconds a stopping replica gives its in-flight streams (``--shutdown-grace``), and
    # Envoy its open ones, before the processes stop.
    drain_seconds: int = 30
    # A kubernetes.io/tls Secret: Envoy also serves HTTPS on ENVOY_HTTPS_PORT.
    tls_secret: str | None = None
    # Mutual TLS between the suite's pods (replicas, pickers, Envoy toward the replicas), with
    # the certificate in the Secret ``<name>-suite-tls`` (tls.crt, tls.key, ca.crt: ``tandem
    # tls init DIR``, or cert-manager). False: plaintext inside the cluster.
    suite_tls: bool = True
    # A Secret whose API_KEYS_ENTRY lists API keys; Envoy then requires one on every request.
    api_key_secret: str | None = None
    gateway_name: str = "inference-gateway"
    image_pull_policy: str = "IfNotPresent"
    # A sidecar in every replica pod keeps its LoRA adapters in step with the ConfigMap
    # ``<name>-lora-adapters`` (adapter directories on the model volume).
    lora_syncer: bool = False
    # KV tiers (deploy.k8s_kv_store): a host-memory tier per replica; the shared tier, an
    # external Redis URL or "statefulset" (a trial Redis rendered with the suite), and a
    # Secret whose "password" key holds its password.
    kv_offload_memory: str | None = None
    kv_store: str | None = None
    kv_store_secret: str | None = None
    # The endpoint picker's prefix-index weight per KV tier (``--kv-tier-weights``); None:
    # its defaults.
    kv_tier_weights: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError("replica counts must not be negative")
        if self.decode + self.both == 0:
            raise ValueError("at least one decode or both replica is needed to serve requests")
        if self.picker_replicas < 1 or self.envoy_replicas < 1:
            raise ValueError("the endpoint picker and Envoy need at least one replica each")
        if self.drain_seconds < 0:
            raise ValueError("drain_seconds must not be negative")
        if self.exclusive_cpus and not (self.replica_cpu.isdigit() and int(self.replica_cpu) > 0):
            raise ValueError(f"exclusive CPUs need a whole number of CPUs per replica, got "
                             f"--replica-cpu {self.replica_cpu!r}")
        if min(self.tensor_parallel_size, self.prefill_tensor_parallel_size or 1) < 1:
            raise ValueError("tensor parallel sizes must be at least 1")
        if self.gpus > 1 and self.gpus != max(self.tensor_parallel_size,
                                              self.prefill_tensor_parallel_size or 1):
            raise ValueError(f"--gpus {self.gpus}: a replica uses one GPU per tensor-parallel "
                             "rank; give --gpus 1 and --tensor-parallel-size N")
        self._check_served_model_names()
        if self.lora_syncer and not self.model_settings.allow_runtime_lora_updating:
            raise ValueError("the LoRA syncer loads adapters while the replicas serve: add "
                             "--allow-runtime-lora-updating")


    def _check_served_model_names(self) -> None:
        """Said at render time, not by replica pods failing to start (the replica refuses a
        base-model name that is also an adapter's; the picker would route such requests as
        the adapter's)."""
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError("--served-model-name: a name must not be empty")
        clash = set(self.served_model_names) & set(self.model_settings.lora_modules)
        if clash:
            raise ValueError(f"--served-model-name {sorted(clash)} also names a LoRA adapter "
                             "(--lora-modules); name the model and the adapters apart")


def suite_tls_secret(options: K8sOptions) -> str:
    return f"{options.name}-suite-tls"


def _suite_tls(options: K8sOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The suite certificate's volume and mount (none without suite TLS)."""
    if not options.suite_tls:
        return [], []
    return ([{"name": "suite-tls", "secret": {"secretName": suite_tls_secret(options),
                                               "defaultMode": 0o440}}],
            [{"name": "suite-tls", "mountPath": SUITE_TLS_DIR, "readOnly": True}])


def _suite_tls_args(options: K8sOptions) -> list[str]:
    return ["--tls-dir", SUITE_TLS_DIR] if options.suite_tls else []


def _labels(options: K8sOptions, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": options.name, "app.kubernetes.io/part-of": "tandem",
            "app.kubernetes.io/component": component}


def _metadata(options: K8sOptions, name: str, labels: dict[str, str]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if options.namespace:
        metadata["namespace"] = options.namespace
    return metadata


def tensor_parallel_size(options: K8sOptions, role: str) -> int:
    """The ranks of one ``role`` replica."""
    if role == "prefill" and options.prefill_tensor_parallel_size is not None:
        return options.prefill_tensor_parallel_size
    return options.tensor_parallel_size


def _scaled(quantity: str, factor: int) -> str:
    """A Kubernetes quantity (``4``, ``500m``, ``16Gi``, ``1.5``) times ``factor``."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", quantity)
    if factor == 1 or match is None:
        return quantity
    number, unit = match.groups()
    value = float(number) * factor
    return f"{int(value) if value.is_integer() else value}{unit}"


def _model_args(options: K8sOptions) -> list[str]:
    """The model and its settings: the replicas and the picker (which renders chats and
    hashes an adapter's prompts as they do, to route them) must agree on them."""
    return ["--model", options.model or IMAGE_DEFAULT_MODEL,
            *model_settings_args(options.model_settings)]


def _model_volumes(options: K8sOptions,
                   ranks: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and their mounts: the model (a PVC, read-only), the writable cache, /tmp and
    /dev/shm (memory: the engine core's tensors; with ``ranks`` tensor-parallel ranks, a GiB
    each: NCCL's shared-memory transport between the ranks' GPUs lives there)."""
    volumes: list[dict[str, Any]] = [
        policy.scratch_volume("cache", "2Gi"),
        policy.tmp_volume(),
        policy.scratch_volume("dshm", f"{ranks}Gi", medium="Memory"),
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "cache", "mountPath": CACHE_DIR},
        policy.tmp_mount(),
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if options.model_pvc:
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": options.model_pvc, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": options.model_mount, "readOnly": True})
    return volumes, mounts


def _env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TANDEM_CACHE_DIR", "value": CACHE_DIR},
        *policy.tmp_env(),
        # Everything a pod needs is in the image or the model volume.
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _grpc_probe(port: int, service: str | None = None, **timing: int) -> dict[str, Any]:
    grpc: dict[str, Any] = {"port": port}
    if service is not None:
        grpc["service"] = service
    return {"grpc": grpc, **timing}


def _deployment(options: K8sOptions, name: str, replicas: int, labels: dict[str, str],
                pod: dict[str, Any], uid: int = policy.TANDEM_UID) -> dict[str, Any]:
    """A Deployment of ``pod`` (a pod spec: containers, volumes, ...), secured and spread."""
    pod = policy.secure_pod(pod, uid)
    pod["topologySpreadConstraints"] = policy.topology_spread(labels)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(options, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": pod,
            },
        },
    }


def _disruption_budget(options: K8sOptions, deployment: dict[str, Any]) -> dict[str, Any]:
    labels = deployment["spec"]["selector"]["matchLabels"]
    return policy.disruption_budget(
        _metadata(options, deployment["metadata"]["name"], labels), labels)


def _replica_args(options: K8sOptions, role: str) -> list[str]:
    args = ["serve", *_model_args(options), "--role", role, "--host", "0.0.0.0",
            "--port", str(REPLICA_PORT), "--metrics-port", str(REPLICA_METRICS_PORT),
            # Kubernetes expands $(VAR) from the container's env in args.
            "--engine-id", "$(POD_NAME)",
            # The address other pods pull KV from: the pod's own, never loopback.
            "--kv-host", "$(POD_IP)",
            "--shutdown-grace", str(options.drain_seconds)]
    if role == "prefill":  # the only role that serves KV pulls
        args += ["--kv-port", str(REPLICA_KV_PORT)]
    if options.suite_tls:
        args += [*_suite_tls_args(options), "--health-port", str(REPLICA_HEALTH_PORT)]
    if options.served_model_names:
        args += ["--served-model-name", *options.served_model_names]
    if tensor_parallel_size(options, role) > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size(options, role))]
    if options.gpus:
        args += ["--device", "cuda"]
    else:
        args += ["--device", "cpu", "--kv-cache-memory", options.kv_cache_memory]
    return args + kv_store.replica_args(options.kv_store, options.name,
                                        options.kv_offload_memory)


def _replica_resources(options: K8sOptions, role: str) -> dict[str, Any]:
    """One replica's share of its node: on the CPU ``replica_cpu`` and ``replica_memory``
    per tensor-parallel rank (each rank an engine process on its own CPUs, with its own KV
    budget); on GPUs one per rank."""
    ranks = tensor_parallel_size(options, role)
    cpu = _scaled(options.replica_cpu, ranks) if not options.gpus else options.replica_cpu
    memory = _scaled(options.replica_memory, ranks)
    resources: dict[str, Any] = {
        "requests": {"cpu": cpu, "memory": memory},
        "limits": {"memory": memory},
    }
    if options.exclusive_cpus:
        resources["limits"]["cpu"] = cpu
    if options.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(max(options.gpus, ranks))
    return resources


def _replica_ports(options: K8sOptions, role: str) -> list[dict[str, Any]]:
    ports = [{"name": "grpc", "containerPort": REPLICA_PORT, "protocol": "TCP"},
             {"name": "metrics", "containerPort": REPLICA_METRICS_PORT, "protocol": "TCP"}]
    if options.suite_tls:
        ports.append({"name": "health", "containerPort": REPLICA_HEALTH_PORT,
                      "protocol": "TCP"})
    if role == "prefill":
        ports.append({"name": "kv", "containerPort": REPLICA_KV_PORT, "protocol": "TCP"})
    return ports


def _replica_container(options: K8sOptions, role: str,
                       mounts: list[dict[str, Any]]) -> dict[str, Any]:
    probe_port = REPLICA_HEALTH_PORT if options.suite_tls else REPLICA_PORT
    return {
        "name": "replica",
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["tandem"],
        "args": _replica_args(options, role),
        "env": [*_env(), {
            # One OpenMP/torch thread per requested core: in a container torch would
            # otherwise start one per core of the node and oversubscribe its share.
            "name": "OMP_NUM_THREADS",
            "valueFrom": {"resourceFieldRef": {"containerName": "replica",
                                               "resource": "requests.cpu", "divisor": "1"}},
        }, *kv_store.replica_env(options.kv_store_secret)],
        "ports": _replica_ports(options, role),
        # Loading the model takes a while; after that, health must answer within seconds.
        "startupProbe": _grpc_probe(probe_port, periodSeconds=5, failureThreshold=120),
        "readinessProbe": _grpc_probe(probe_port, periodSeconds=5, failureThreshold=2),
        "livenessProbe": _grpc_probe(probe_port, periodSeconds=10, failureThreshold=3),
        # SIGTERM (after the preStop sleep) drains: NOT_SERVING, new requests refused,
        # in-flight streams finish within --shutdown-grace.
        "lifecycle": policy.pre_stop_sleep(PRE_STOP_S),
        "resources": _replica_resources(options, role),
        "volumeMounts": mounts,
    }


def replica_deployment(options: K8sOptions, role: str, replicas: int) -> dict[str, Any]:
    labels = {**_labels(options, "replica"), ROLE_LABEL: role}
    if role in DECODE_CAPABLE:
        labels[POOL_LABEL] = options.name
    volumes, mounts = _model_volumes(options, tensor_parallel_size(options, role))
    tls_volumes, tls_mounts = _suite_tls(options)
    volumes, mounts = volumes + tls_volumes, mounts + tls_mounts
    pod: dict[str, Any] = {"containers": [_replica_container(options, role, mounts)],
                           "volumes": volumes}
    if options.lora_syncer:
        volumes.append({"name": "lora-adapters",
                        "configMap": {"name": lora_adapters_name(options)}})
        pod["initContainers"] = [_lora_syncer(options)]
    pod["terminationGracePeriodSeconds"] = policy.termination_grace_s(
        PRE_STOP_S, options.drain_seconds)
    return _deployment(options, f"{options.name}-{role}", replicas, labels, pod)


def lora_adapters_name(options: K8sOptions) -> str:
    return f"{options.name}-lora-adapters"


def lora_adapters_config_map(options: K8sOptions) -> dict[str, Any]:
    """The adapters every replica serves, none at first: edit it (``kubectl edit configmap``)
    to roll adapters out; the kubelet updates the mounted file within a minute or so."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(options, lora_adapters_name(options),
                              _labels(options, "lora-syncer")),
        "data": {LORA_CONFIG_ENTRY: render_config()},
    }


def _lora_syncer(options: K8sOptions) -> dict[str, Any]:
    """A native sidecar (an init container that keeps running, Kubernetes 1.29 and later):
    it talks to its pod's replica over loopback and loads the adapters again when the
    replica restarts."""
    return {
        "name": "lora-syncer",
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["tandem"],
        "args": ["lora", "sync", "--config", f"{LORA_CONFIG_DIR}/{LORA_CONFIG_ENTRY}",
                 "--target", f"127.0.0.1:{REPLICA_PORT}", *_suite_tls_args(options)],
        "env": [*policy.tmp_env(), {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                      "limits": {"memory": "256Mi"}},
        "volumeMounts": [{"name": "lora-adapters", "mountPath": LORA_CONFIG_DIR,
                          "readOnly": True}, policy.tmp_mount(), *_suite_tls(options)[1]],
    }


def replica_service(options: K8sOptions, role: str) -> dict[str, Any]:
    """Headless: its DNS name resolves to every ready pod's IP, which is what the endpoint
    picker routes to."""
    selector = {**_labels(options, "replica"), ROLE_LABEL: role}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, f"{options.name}-{role}", selector),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [
                {"name": "grpc", "port": REPLICA_PORT, "targetPort": "grpc",
                 "appProtocol": "kubernetes.io/h2c"},
                {"name": "metrics", "port": REPLICA_METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def _roles(options: K8sOptions) -> list[tuple[str, int]]:
    counts = {"prefill": options.prefill, "decode": options.decode, "both": options.both}
    return [(role, counts[role]) for role in ROLES if counts[role] > 0]


def _tier_weight_args(options: K8sOptions) -> list[str]:
    weights = options.kv_tier_weights
    return [] if weights is None else ["--kv-tier-weights", format_tier_weights(weights)]


def picker_deployment(options: K8sOptions) -> dict[str, Any]:
    labels = _labels(options, "endpoint-picker")
    volumes, mounts = _model_volumes(options)
    tls_volumes, tls_mounts = _suite_tls(options)
    volumes, mounts = volumes + tls_volumes, mounts + tls_mounts
    dns = [arg for role, _ in _roles(options)
           for arg in ("--dns", f"{options.name}-{role}:{REPLICA_PORT}")]
    container = {
        "name": "endpoint-picker",
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["tandem"],
        "args": ["picker", *_model_args(options), "--host", "0.0.0.0", "--port", str(PICKER_PORT),
                 "--metrics-port", str(PICKER_METRICS_PORT), *_suite_tls_args(options),
                 *_tier_weight_args(options), *dns],
        "env": _env(),
        "ports": [
            {"name": "grpc", "containerPort": PICKER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": PICKER_METRICS_PORT, "protocol": "TCP"},
        ],
        # The endpoint-picker protocol's health services.
        "startupProbe": _grpc_probe(PICKER_PORT, "liveness", periodSeconds=5,
                                    failureThreshold=60),
        "livenessProbe": _grpc_probe(PICKER_PORT, "liveness", periodSeconds=10),
        "readinessProbe": _grpc_probe(PICKER_PORT, "readiness", periodSeconds=5),
        # Envoy's connection to the picker's Service moves to another picker when this one
        # leaves the endpoints; a pick in flight at SIGTERM fails (FailClose) and is retried
        # by the client.
        "lifecycle": policy.pre_stop_sleep(PRE_STOP_S),
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = {
        "containers": [container], "volumes": volumes,
        "terminationGracePeriodSeconds": policy.termination_grace_s(PRE_STOP_S, 1)}
    return _deployment(options, f"{options.name}-epp", options.picker_replicas, labels, pod)


def picker_service(options: K8sOptions) -> dict[str, Any]:
    labels = _labels(options, "endpoint-picker")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, f"{options.name}-epp", labels),
        "spec": {
            "selector": labels,
            "ports": [
                {"name": "grpc", "port": PICKER_PORT, "targetPort": "grpc",
                 "appProtocol": "kubernetes.io/h2c"},
                {"name": "metrics", "port": PICKER_METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def envoy_bootstrap(options: K8sOptions, descriptor: bytes) -> dict[str, Any]:
    tls = (TlsFiles(f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", ENVOY_HTTPS_PORT)
           if options.tls_secret else None)
    return render_picker_bootstrap(
        ENVOY_HTTP_PORT, f"{options.name}-epp:{PICKER_PORT}", admin_port=ENVOY_ADMIN_PORT,
        listen_host="0.0.0.0", descriptor=descriptor, tls=tls,
        # /metrics on Envoy's port answers the picker's (routing decisions, replicas).
        metrics=f"{options.name}-epp:{PICKER_METRICS_PORT}",
        upstream_tls_dir=SUITE_TLS_DIR if options.suite_tls else None)


def envoy_config_map(options: K8sOptions, bootstrap_yaml: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(options, f"{options.name}-envoy", _labels(options, "envoy")),
        "data": {"envoy.yaml": bootstrap_yaml},
    }


def _api_keys_init(options: K8sOptions) -> dict[str, Any]:
    """The keys stay in their Secret: this init container (Tandem's image, run as Envoy's
    user so that Envoy can read what it writes) adds them to the ConfigMap's bootstrap in a
    pod-private volume, which Envoy then reads."""
    return {
        "name": "add-api-keys",
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["tandem", "render", "envoy",
                    "--bootstrap", f"{ENVOY_TEMPLATE_DIR}/envoy.yaml",
                    "--api-key-file", f"{API_KEYS_DIR}/{API_KEYS_ENTRY}",
                    "-o", f"{ENVOY_CONFIG_DIR}/envoy.yaml"],
        "env": policy.tmp_env(),
        "volumeMounts": [
            {"name": "config", "mountPath": ENVOY_TEMPLATE_DIR, "readOnly": True},
            {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True},
            {"name": "keyed-config", "mountPath": ENVOY_CONFIG_DIR},
            policy.tmp_mount()],
    }


def _envoy_volumes(options: K8sOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{options.name}-envoy"}},
        policy.tmp_volume()]
    config_volume = "config"
    if options.api_key_secret:
        volumes += [{"name": "api-keys", "secret": {"secretName": options.api_key_secret}},
                    policy.scratch_volume("keyed-config", "16Mi", medium="Memory")]
        config_volume = "keyed-config"
    mounts: list[dict[str, Any]] = [
        {"name": config_volume, "mountPath": ENVOY_CONFIG_DIR, "readOnly": True},
        policy.tmp_mount()]
    if options.tls_secret:
        volumes.append({"name": "tls", "secret": {"secretName": options.tls_secret}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    tls_volumes, tls_mounts = _suite_tls(options)
    return volumes + tls_volumes, mounts + tls_mounts


def envoy_deployment(options: K8sOptions) -> dict[str, Any]:
    labels = _labels(options, "envoy")
    volumes, mounts = _envoy_volumes(options)
    ports = [{"name": "http", "containerPort": ENVOY_HTTP_PORT, "protocol": "TCP"}]
    if options.tls_secret:
        ports.append({"name": "https", "containerPort": ENVOY_HTTPS_PORT, "protocol": "TCP"})
    container = {
        "name": "envoy",
        "image": options.envoy_image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["envoy"],
        "args": ["-c", f"{ENVOY_CONFIG_DIR}/envoy.yaml", "--disable-hot-restart",
                 "--log-level", "warn"],
        "ports": ports,
        "readinessProbe": {"tcpSocket": {"port": ENVOY_HTTP_PORT}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": ENVOY_HTTP_PORT}, "periodSeconds": 10},
        # Envoy stops at once on SIGTERM: it keeps serving its open streams for the drain
        # period while the Service drops it, then stops.
        "lifecycle": policy.pre_stop_sleep(options.drain_seconds),
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes,
                           "terminationGracePeriodSeconds": policy.termination_grace_s(
                               options.drain_seconds, 0)}
    if options.api_key_secret:
        pod["initContainers"] = [_api_keys_init(options)]
    return _deployment(options, f"{options.name}-envoy", options.envoy_replicas, labels, pod,
                       uid=policy.ENVOY_UID)


def envoy_service(options: K8sOptions) -> dict[str, Any]:
    labels = _labels(options, "envoy")
    # h2c: Envoy's listener takes HTTP/1.1 and HTTP/2 alike, and gRPC calls come this way
    # when API keys are required.
    ports = [{"name": "http", "port": ENVOY_HTTP_PORT, "targetPort": "http",
              "appProtocol": "kubernetes.io/h2c"}]
    if options.tls_secret:
        ports.append({"name": "https", "port": ENVOY_HTTPS_PORT, "targetPort": "https",
                      "appProtocol": "https"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, f"{options.name}-openai", labels),
        "spec": {"selector": labels, "ports": ports},
    }


def inference_pool(options: K8sOptions) -> dict[str, Any]:
    return {
        "apiVersion": f"{INFERENCE_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": _metadata(options, options.name, _labels(options, "inference-pool")),
        "spec": {
            # Only the decode-capable replicas serve a request end to end.
            "selector": {"matchLabels": {POOL_LABEL: options.name}},
            "targetPorts": [{"number": REPLICA_PORT}],
            "appProtocol": "kubernetes.io/h2c",  # the replicas speak gRPC
            "endpointPickerRef": {
                "kind": "Service",
                "name": f"{options.name}-epp",
                "port": {"number": PICKER_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def http_route(options: K8sOptions) -> dict[str, Any]:
    openai_paths = [{"path": {"type": "PathPrefix", "value": "/v1/"}},
                    {"path": {"type": "Exact", "value": "/tokenize"}},
                    {"path": {"type": "Exact", "value": "/detokenize"}}]
    envoy = {"name": f"{options.name}-openai", "port": ENVOY_HTTP_PORT}
    pool = {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": options.name}
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": _metadata(options, options.name, _labels(options, "route")),
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                            "name": options.gateway_name}],
            "rules": [
                {   # gRPC clients (the SDK): straight to the replica the picker names, or
                    # through Envoy's API-key check when keys are required
                    "matches": [{"path": {"type": "PathPrefix",
                                          "value": "/tandem.v1.Generation/"}}],
                    "backendRefs": [envoy if options.api_key_secret else pool],
                },
                {   # OpenAI JSON: Envoy transcodes it to gRPC (and asks the same picker)
                    "matches": openai_paths,
                    "backendRefs": [dict(envoy)],
                },
            ],
        },
    }


def render_k8s_manifests(options: K8sOptions,
                         descriptor: bytes | None = None) -> list[dict[str, Any]]:
    """Every object, in an order ``kubectl apply`` can take them in."""
    descriptor = descriptor if descriptor is not None else Path(DEFAULT_DESCRIPTOR).read_bytes()
    objects: list[dict[str, Any]] = [
        envoy_config_map(options, dump_yaml(envoy_bootstrap(options, descriptor)))]
    if options.kv_store == kv_store.IN_CLUSTER:
        objects += kv_store.trial_store(options.name, options.namespace,
                                        _labels(options, "kv-store"))
    if options.lora_syncer:
        objects.append(lora_adapters_config_map(options))
    deployments = [replica_deployment(options, role, count) for role, count in _roles(options)]
    for (role, _), deployment in zip(_roles(options), deployments, strict=True):
        objects += [replica_service(options, role), deployment,
                    _disruption_budget(options, deployment)]
    picker, envoy = picker_deployment(options), envoy_deployment(options)
    objects += [picker_service(options), picker, _disruption_budget(options, picker),
                envoy_service(options), envoy, _disruption_budget(options, envoy),
                inference_pool(options), http_route(options)]
    return objects
