"""Tandem's Kubernetes manifests, rendered as plain dicts (one per object).

Owns what a cluster runs and how the pieces find each other:

- replicas: one Deployment per role (``prefill``, ``decode``, and ``both`` when asked for),
  each behind a headless Service (the endpoint picker resolves its pod IPs), with gRPC health
  probes, resources, the model volume and the engine id taken from the pod name;
- the endpoint picker (``tandem picker``): a Deployment and a Service, the
  ``ext_proc`` server that both the InferencePool and Tandem's own Envoy ask where a request
  goes;
- Envoy, Tandem's OpenAI-compatible HTTP front: a ConfigMap holding the bootstrap
  (``envoy_config.render_picker_bootstrap``, descriptor inlined), a Deployment running the
  official Envoy image on it and a Service, with TLS on a second port when a Secret is named
  and API keys from a Secret (added to the bootstrap by an init container) when one is named;
- with ``lora_syncer``, a ConfigMap naming the LoRA adapters to serve and a sidecar in every
  replica pod (``tandem lora sync``) that loads and unloads them as the ConfigMap changes;
- an ``InferencePool`` (``inference.networking.k8s.io/v1``) of the decode-capable replicas,
  their gRPC port over h2c and the endpoint picker as its ``endpointPickerRef``, and an
  ``HTTPRoute`` (``gateway.networking.k8s.io/v1``) on an existing Gateway: gRPC calls of
  ``tandem.v1.Generation`` go to the InferencePool, OpenAI HTTP paths to Envoy.

It does not own writing files (``render``) or the Gateway itself (a cluster's own, named by
``gateway_name``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.envoy_config import (
    DEFAULT_DESCRIPTOR,
    TlsFiles,
    dump_bootstrap,
    render_picker_bootstrap,
)
from engine_common.config import ModelSettings
from services.model_settings import model_settings_args
from tandem.lora_sync import render_config

REPLICA_PORT = 50051
REPLICA_METRICS_PORT = 9400
PICKER_PORT = 9002
PICKER_METRICS_PORT = 9090
ENVOY_HTTP_PORT = 8080
ENVOY_HTTPS_PORT = 8443
ENVOY_ADMIN_PORT = 9901
ENVOY_CONFIG_DIR = "/etc/envoy"
ENVOY_TEMPLATE_DIR = "/etc/envoy-template"
API_KEYS_DIR = "/etc/tandem-api-keys"
API_KEYS_ENTRY = "api-keys"
TLS_DIR = "/etc/tandem/tls"
CACHE_DIR = "/var/cache/tandem"
LORA_CONFIG_DIR = "/etc/tandem/lora"
LORA_CONFIG_ENTRY = "configmap.yaml"  # the inference extension's LoRA syncer's file name
ROLE_LABEL = "tandem.dev/role"
POOL_LABEL = "tandem.dev/inference-pool"
INFERENCE_GROUP = "inference.networking.k8s.io"
ROLES = ("prefill", "decode", "both")
DECODE_CAPABLE = ("decode", "both")


@dataclass(frozen=True)
class K8sOptions:
    image: str
    # The model directory inside the containers; None: the bundled default model, converted
    # at start into a per-pod cache.
    model: str | None = None
    name: str = "tandem"
    namespace: str | None = None
    prefill: int = 1
    decode: int = 1
    both: int = 0
    # A PersistentVolumeClaim holding the model, mounted read-only at model_mount.
    model_pvc: str | None = None
    model_mount: str = "/models"
    served_model_name: str | None = None
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
    kv_cache_memory: str = "2GiB"  # CPU KV cache; on GPU the engine sizes its own
    envoy_image: str = "envoyproxy/envoy:v1.40.0"
    envoy_replicas: int = 1
    picker_replicas: int = 1
    # A kubernetes.io/tls Secret: Envoy also serves HTTPS on ENVOY_HTTPS_PORT.
    tls_secret: str | None = None
    # A Secret whose API_KEYS_ENTRY lists API keys; Envoy then requires one on every request.
    api_key_secret: str | None = None
    gateway_name: str = "inference-gateway"
    image_pull_policy: str = "IfNotPresent"
    # A sidecar in every replica pod keeps its LoRA adapters in step with the ConfigMap
    # ``<name>-lora-adapters`` (adapter directories on the model volume).
    lora_syncer: bool = False

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError("replica counts must not be negative")
        if self.decode + self.both == 0:
            raise ValueError("at least one decode or both replica is needed to serve requests")
        if self.exclusive_cpus and not (self.replica_cpu.isdigit() and int(self.replica_cpu) > 0):
            raise ValueError(f"exclusive CPUs need a whole number of CPUs per replica, got "
                             f"--replica-cpu {self.replica_cpu!r}")
        if self.lora_syncer and not self.model_settings.allow_runtime_lora_updating:
            raise ValueError("the LoRA syncer loads adapters while the replicas serve: add "
                             "--allow-runtime-lora-updating")


def _labels(options: K8sOptions, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": options.name, "app.kubernetes.io/part-of": "tandem",
            "app.kubernetes.io/component": component}


def _metadata(options: K8sOptions, name: str, labels: dict[str, str]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if options.namespace:
        metadata["namespace"] = options.namespace
    return metadata


def _model_args(options: K8sOptions) -> list[str]:
    """The model and its settings: the replicas and the picker (which renders chats and
    hashes an adapter's prompts as they do, to route them) must agree on them."""
    return [*(["--model", options.model] if options.model else []),
            *model_settings_args(options.model_settings)]


def _model_volumes(options: K8sOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and their mounts: the model (a PVC, read-only), a cache for the default model's
    conversion and /dev/shm for the engine core's tensors."""
    volumes: list[dict[str, Any]] = [
        {"name": "cache", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "cache", "mountPath": CACHE_DIR},
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
                container: dict[str, Any], volumes: list[dict[str, Any]],
                init_containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if init_containers:
        pod["initContainers"] = init_containers
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(options, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": pod,
            },
        },
    }


def replica_deployment(options: K8sOptions, role: str, replicas: int) -> dict[str, Any]:
    labels = {**_labels(options, "replica"), ROLE_LABEL: role}
    if role in DECODE_CAPABLE:
        labels[POOL_LABEL] = options.name
    volumes, mounts = _model_volumes(options)
    args = ["serve", *_model_args(options), "--role", role, "--host", "0.0.0.0",
            "--port", str(REPLICA_PORT), "--metrics-port", str(REPLICA_METRICS_PORT),
            # Kubernetes expands $(VAR) from the container's env in args.
            "--engine-id", "$(POD_NAME)"]
    if options.served_model_name:
        args += ["--served-model-name", options.served_model_name]
    resources: dict[str, Any] = {
        "requests": {"cpu": options.replica_cpu, "memory": options.replica_memory},
        "limits": {"memory": options.replica_memory},
    }
    if options.exclusive_cpus:
        resources["limits"]["cpu"] = options.replica_cpu
    if options.gpus:
        args += ["--device", "cuda"]
        resources["limits"]["nvidia.com/gpu"] = str(options.gpus)
    else:
        args += ["--device", "cpu", "--kv-cache-memory", options.kv_cache_memory]
    container = {
        "name": "replica",
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["tandem"],
        "args": args,
        "env": [*_env(), {
            # One OpenMP/torch thread per requested core: in a container torch would
            # otherwise start one per core of the node and oversubscribe its share.
            "name": "OMP_NUM_THREADS",
            "valueFrom": {"resourceFieldRef": {"containerName": "replica",
                                               "resource": "requests.cpu", "divisor": "1"}},
        }],
        "ports": [
            {"name": "grpc", "containerPort": REPLICA_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": REPLICA_METRICS_PORT, "protocol": "TCP"},
        ],
        # Loading the model takes a while; after that, health must answer within seconds.
        "startupProbe": _grpc_probe(REPLICA_PORT, periodSeconds=5, failureThreshold=120),
        "readinessProbe": _grpc_probe(REPLICA_PORT, periodSeconds=5, failureThreshold=2),
        "livenessProbe": _grpc_probe(REPLICA_PORT, periodSeconds=10, failureThreshold=3),
        "resources": resources,
        "volumeMounts": mounts,
    }
    sidecars = []
    if options.lora_syncer:
        volumes.append({"name": "lora-adapters",
                        "configMap": {"name": lora_adapters_name(options)}})
        sidecars.append(_lora_syncer(options))
    deployment = _deployment(options, f"{options.name}-{role}", replicas, labels, container,
                             volumes, sidecars)
    # In-flight requests get the replica's own drain period (30 s) before SIGKILL.
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 45
    return deployment


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
                 "--target", f"127.0.0.1:{REPLICA_PORT}"],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                      "limits": {"memory": "256Mi"}},
        "volumeMounts": [{"name": "lora-adapters", "mountPath": LORA_CONFIG_DIR,
                          "readOnly": True}],
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


def picker_deployment(options: K8sOptions) -> dict[str, Any]:
    labels = _labels(options, "endpoint-picker")
    volumes, mounts = _model_volumes(options)
    dns = [arg for role, _ in _roles(options)
           for arg in ("--dns", f"{options.name}-{role}:{REPLICA_PORT}")]
    container = {
        "name": "endpoint-picker",
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["tandem"],
        "args": ["picker", *_model_args(options), "--host", "0.0.0.0", "--port", str(PICKER_PORT),
                 "--metrics-port", str(PICKER_METRICS_PORT), *dns],
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
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": mounts,
    }
    return _deployment(options, f"{options.name}-epp", options.picker_replicas, labels,
                       container, volumes)


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
        listen_host="0.0.0.0", descriptor=descriptor, tls=tls)


def envoy_config_map(options: K8sOptions, bootstrap_yaml: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(options, f"{options.name}-envoy", _labels(options, "envoy")),
        "data": {"envoy.yaml": bootstrap_yaml},
    }


def envoy_deployment(options: K8sOptions) -> dict[str, Any]:
    labels = _labels(options, "envoy")
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{options.name}-envoy"}}]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": ENVOY_CONFIG_DIR, "readOnly": True}]
    init_containers: list[dict[str, Any]] = []
    if options.api_key_secret:
        # The keys stay in their Secret: an init container (Tandem's image) adds them to the
        # ConfigMap's bootstrap in a pod-private volume, which Envoy then reads.
        volumes += [{"name": "api-keys", "secret": {"secretName": options.api_key_secret}},
                    {"name": "keyed-config", "emptyDir": {"medium": "Memory"}}]
        mounts = [{"name": "keyed-config", "mountPath": ENVOY_CONFIG_DIR, "readOnly": True}]
        init_containers.append({
            "name": "add-api-keys",
            "image": options.image,
            "imagePullPolicy": options.image_pull_policy,
            "command": ["tandem", "render", "envoy",
                        "--bootstrap", f"{ENVOY_TEMPLATE_DIR}/envoy.yaml",
                        "--api-key-file", f"{API_KEYS_DIR}/{API_KEYS_ENTRY}",
                        "-o", f"{ENVOY_CONFIG_DIR}/envoy.yaml"],
            "volumeMounts": [
                {"name": "config", "mountPath": ENVOY_TEMPLATE_DIR, "readOnly": True},
                {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True},
                {"name": "keyed-config", "mountPath": ENVOY_CONFIG_DIR}],
        })
    ports = [{"name": "http", "containerPort": ENVOY_HTTP_PORT, "protocol": "TCP"}]
    if options.tls_secret:
        volumes.append({"name": "tls", "secret": {"secretName": options.tls_secret}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
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
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "volumeMounts": mounts,
    }
    return _deployment(options, f"{options.name}-envoy", options.envoy_replicas, labels,
                       container, volumes, init_containers)


def envoy_service(options: K8sOptions) -> dict[str, Any]:
    labels = _labels(options, "envoy")
    ports = [{"name": "http", "port": ENVOY_HTTP_PORT, "targetPort": "http",
              "appProtocol": "http"}]
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
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": _metadata(options, options.name, _labels(options, "route")),
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                            "name": options.gateway_name}],
            "rules": [
                {   # gRPC clients (the SDK): straight to the replica the picker names
                    "matches": [{"path": {"type": "PathPrefix",
                                          "value": "/tandem.v1.Generation/"}}],
                    "backendRefs": [{"group": INFERENCE_GROUP, "kind": "InferencePool",
                                     "name": options.name}],
                },
                {   # OpenAI JSON: Envoy transcodes it to gRPC (and asks the same picker)
                    "matches": openai_paths,
                    "backendRefs": [{"name": f"{options.name}-openai",
                                     "port": ENVOY_HTTP_PORT}],
                },
            ],
        },
    }


def render_k8s_manifests(options: K8sOptions,
                         descriptor: bytes | None = None) -> list[dict[str, Any]]:
    """Every object, in an order ``kubectl apply`` can take them in."""
    descriptor = descriptor if descriptor is not None else Path(DEFAULT_DESCRIPTOR).read_bytes()
    objects: list[dict[str, Any]] = [
        envoy_config_map(options, dump_bootstrap(envoy_bootstrap(options, descriptor)))]
    if options.lora_syncer:
        objects.append(lora_adapters_config_map(options))
    for role, count in _roles(options):
        objects += [replica_service(options, role), replica_deployment(options, role, count)]
    objects += [picker_service(options), picker_deployment(options),
                envoy_service(options), envoy_deployment(options),
                inference_pool(options), http_route(options)]
    return objects
