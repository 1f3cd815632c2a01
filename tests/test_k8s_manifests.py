"""``tandem render k8s``: every object checked against the real schemas, offline.

Core, apps and policy objects go through ``kubernetes-validate``'s strict schemas (unknown
fields rejected) for the oldest and newest Kubernetes the manifests are for, and are
deserialized into the ``kubernetes`` client's models and serialized back unchanged. The
InferencePool and HTTPRoute go through their CRDs' structural schemas from
``../shared/schemas`` with unknown fields rejected (``tests/k8s_schemas``); the CEL rules that
concern them are checked by hand below, with their sources. The Envoy bootstrap inside the
ConfigMap goes through the real ``envoy --mode validate``. Production settings (security
contexts, disruption budgets, spread, draining stops, ports, routable KV addresses) are
checked against the flags the real processes parse.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient

from deploy.cli import build_parser as tandem_parser
from deploy.envoy_runner import find_envoy
from deploy.k8s import (
    DEFAULT_IMAGE,
    ENVOY_HTTP_PORT,
    ENVOY_HTTPS_PORT,
    IMAGE_DEFAULT_MODEL,
    PICKER_METRICS_PORT,
    PICKER_PORT,
    POOL_LABEL,
    PRE_STOP_S,
    REPLICA_HEALTH_PORT,
    REPLICA_KV_PORT,
    REPLICA_METRICS_PORT,
    REPLICA_PORT,
    ROLE_LABEL,
    SUITE_TLS_DIR,
    TLS_DIR,
    K8sOptions,
    render_k8s_manifests,
)
from deploy.k8s_pod_policy import ENVOY_UID, TANDEM_UID
from deploy.local_ca import make_suite_certificates
from deploy.lora_sync import WantedAdapters, parse_wanted_adapters
from deploy.render import main as render_main
from deploy.render import write_manifests
from engine_common.config import ModelSettings
from gateway.endpoint_picker_main import build_parser as picker_parser
from gateway.endpoint_picker_main import options_from_args as picker_options
from services.replica.main import build_parser as replica_parser
from services.replica.main import options_from_args as replica_options
from tests.k8s_schemas import K8S_VERSIONS, SchemaError, validate_object

REPO = Path(__file__).resolve().parents[1]
MODELS = {"ConfigMap": "V1ConfigMap", "Service": "V1Service", "Deployment": "V1Deployment",
          "PodDisruptionBudget": "V1PodDisruptionBudget"}

pytestmark = pytest.mark.timeout(120)

# --- InferencePool, inference.networking.k8s.io/v1 --------------------------------------
# Source: kubernetes-sigs/gateway-api-inference-extension, api/v1/inferencepool_types.go
# and api/v1/shared_types.go (main after v1.5.0, where spec.appProtocol exists and
# endpointPickerRef became optional; Tandem always sets it, as v1.0-v1.4 required).
POOL_SPEC_FIELDS = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
POOL_REQUIRED = {"selector", "targetPorts"}
POOL_APP_PROTOCOLS = {"http", "kubernetes.io/h2c"}  # +kubebuilder:validation:Enum
POOL_MAX_TARGET_PORTS = 8  # MinItems=1, MaxItems=8, numbers unique
PICKER_REF_FIELDS = {"group", "kind", "name", "port", "failureMode"}
FAILURE_MODES = {"FailOpen", "FailClose"}
# LabelKey / LabelValue patterns (Kubernetes qualified names), matchLabels MaxItems=64.
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")

# --- HTTPRoute, gateway.networking.k8s.io/v1 ----------------------------------------------
# Source: kubernetes-sigs/gateway-api, apis/v1/httproute_types.go and shared_types.go
# (BackendObjectReference's CEL rule "Must have port for Service reference"; at most 16 rules,
# 64 matches per rule, 16 backendRefs per rule; path types Exact, PathPrefix,
# RegularExpression, values starting with "/").
PATH_TYPES = {"Exact", "PathPrefix", "RegularExpression"}
MAX_RULES, MAX_MATCHES, MAX_BACKENDS = 16, 64, 16


@functools.cache
def _suite_secret() -> str:
    """The suite's Secret as a pod sees it mounted (the options read the files)."""
    return str(make_suite_certificates(Path(tempfile.mkdtemp(prefix="suite-tls-"))))


def _mounted(args: list[str]) -> list[str]:
    return [_suite_secret() if arg == SUITE_TLS_DIR else arg for arg in args]


def parsed_replica(args: list[str]) -> Any:
    """What ``tandem serve`` makes of rendered args."""
    return replica_options(replica_parser().parse_args(_mounted(args)))


def parsed_picker(args: list[str]) -> Any:
    """What ``tandem picker`` makes of rendered args."""
    return picker_options(picker_parser().parse_args(_mounted(args)))


def render(**overrides: Any) -> list[dict[str, Any]]:
    options = K8sOptions(image="registry.example/tandem:0.1", model="/models/llama",
                         model_pvc="llama-weights", **overrides)
    return render_k8s_manifests(options)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_core_objects_round_trip_through_the_kubernetes_models() -> None:
    api = ApiClient()
    objects = render(prefill=2, decode=3, both=1, tls_secret="tandem-tls", namespace="llm")
    for obj in objects:
        if obj["kind"] not in MODELS:
            continue
        model = api._ApiClient__deserialize(obj, MODELS[obj["kind"]])  # type: ignore[attr-defined]
        assert api.sanitize_for_serialization(model) == obj, obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == "llm"
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("Deployment") == 5  # prefill, decode, both, picker, Envoy
    assert kinds.count("Service") == 5 and kinds.count("ConfigMap") == 1
    assert kinds.count("PodDisruptionBudget") == 5  # one per Deployment


def test_replicas_have_roles_probes_model_and_headless_services() -> None:
    objects = render(prefill=2, decode=3, gpus=1)
    deployments, services = by_kind(objects, "Deployment"), by_kind(objects, "Service")
    for role, count in (("prefill", 2), ("decode", 3)):
        deployment = deployments[f"tandem-{role}"]
        assert deployment["spec"]["replicas"] == count
        pod = deployment["spec"]["template"]
        container = pod["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--role") + 1] == role
        assert args[args.index("--model") + 1] == "/models/llama"
        assert args[args.index("--engine-id") + 1] == "$(POD_NAME)"
        assert {e["name"] for e in container["env"]} >= {"POD_NAME", "HF_HUB_OFFLINE"}
        threads = next(e for e in container["env"] if e["name"] == "OMP_NUM_THREADS")
        assert threads["valueFrom"]["resourceFieldRef"] == {
            "containerName": container["name"], "resource": "requests.cpu", "divisor": "1"}
        # The gRPC port wants the suite's certificate; the kubelet probes the health port.
        assert args[args.index("--health-port") + 1] == str(REPLICA_HEALTH_PORT)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": REPLICA_HEALTH_PORT}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        # Every mount names a declared volume; the model is the claim, read-only.
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": "llama-weights", "readOnly": True}
        # The selector picks exactly this Deployment's pods.
        labels = pod["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels
        assert labels[ROLE_LABEL] == role
        assert (POOL_LABEL in labels) == (role == "decode")  # prefill is not in the pool
        service = services[f"tandem-{role}"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= labels.items()
        port_names = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_picker_resolves_every_replica_service_and_probes_its_health_services() -> None:
    objects = render(prefill=1, decode=1, both=2)
    picker = by_kind(objects, "Deployment")["tandem-epp"]["spec"]["template"]["spec"]
    container = picker["containers"][0]
    args = container["args"]
    dns = [args[i + 1] for i, arg in enumerate(args) if arg == "--dns"]
    assert dns == [f"tandem-{role}:{REPLICA_PORT}" for role in ("prefill", "decode", "both")]
    assert set(dns) <= {f"{name}:{REPLICA_PORT}" for name in by_kind(objects, "Service")}
    assert container["readinessProbe"]["grpc"] == {"port": PICKER_PORT, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": PICKER_PORT, "service": "liveness"}


def test_inference_pool_matches_its_published_schema() -> None:
    objects = render(decode=2, both=1)
    pool = by_kind(objects, "InferencePool")["tandem"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert POOL_REQUIRED <= set(spec) <= POOL_SPEC_FIELDS
    assert set(spec["selector"]) == {"matchLabels"}
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64
    assert all(LABEL_KEY.match(k) and len(k) <= 253 and LABEL_VALUE.match(v) and len(v) <= 63
               for k, v in labels.items())
    ports = spec["targetPorts"]
    assert 1 <= len(ports) <= POOL_MAX_TARGET_PORTS
    assert all(set(p) == {"number"} and 1 <= p["number"] <= 65535 for p in ports)
    assert spec["appProtocol"] in POOL_APP_PROTOCOLS and spec["appProtocol"] == "kubernetes.io/h2c"
    ref = spec["endpointPickerRef"]
    assert set(ref) <= PICKER_REF_FIELDS and ref["name"]
    assert KIND.match(ref["kind"]) and ref["failureMode"] in FAILURE_MODES
    # CEL: "port is required when kind is 'Service'" (the Service port, not the target port).
    assert ref["kind"] == "Service" and ref["port"] == {"number": PICKER_PORT}
    picker_service = by_kind(objects, "Service")[ref["name"]]
    assert PICKER_PORT in {p["port"] for p in picker_service["spec"]["ports"]}
    # The pool holds the decode-capable pods, on the port they serve.
    for name in ("tandem-decode", "tandem-both"):
        template = by_kind(objects, "Deployment")[name]["spec"]["template"]
        assert labels.items() <= template["metadata"]["labels"].items()
        assert ports[0]["number"] in {
            p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    prefill = by_kind(objects, "Deployment")["tandem-prefill"]["spec"]["template"]
    assert not labels.items() <= prefill["metadata"]["labels"].items()


def test_http_route_matches_its_published_schema() -> None:
    objects = render()
    route = by_kind(objects, "HTTPRoute")["tandem"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert all(ref["name"] for ref in spec["parentRefs"])
    assert 1 <= len(spec["rules"]) <= MAX_RULES
    services = by_kind(objects, "Service")
    pools = by_kind(objects, "InferencePool")
    for rule in spec["rules"]:
        assert 1 <= len(rule["matches"]) <= MAX_MATCHES
        for match in rule["matches"]:
            assert match["path"]["type"] in PATH_TYPES
            assert match["path"]["value"].startswith("/")
        assert 1 <= len(rule["backendRefs"]) <= MAX_BACKENDS
        for ref in rule["backendRefs"]:
            group, kind = ref.get("group", ""), ref.get("kind", "Service")
            if group == "" and kind == "Service":
                assert "port" in ref, "Must have port for Service reference"
                assert ref["port"] in {p["port"] for p in services[ref["name"]]["spec"]["ports"]}
            else:
                assert (group, kind) == ("inference.networking.k8s.io", "InferencePool")
                assert ref["name"] in pools
    grpc_rule = spec["rules"][0]
    assert grpc_rule["matches"][0]["path"]["value"] == "/tandem.v1.Generation/"


def test_envoy_config_map_is_a_valid_bootstrap_with_tls(tmp_path: Path) -> None:
    objects = render(tls_secret="tandem-tls")
    bootstrap = by_kind(objects, "ConfigMap")["tandem-envoy"]["data"]["envoy.yaml"]
    config = yaml.safe_load(bootstrap)
    listeners = config["static_resources"]["listeners"]
    assert [entry["address"]["socket_address"]["port_value"] for entry in listeners] == [8080, 8443]
    picker = config["static_resources"]["clusters"][0]
    assert picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"] == {
        "address": {"socket_address": {"address": "tandem-epp", "port_value": PICKER_PORT}}}
    envoy = by_kind(objects, "Deployment")["tandem-envoy"]["spec"]["template"]["spec"]
    assert {"secret": {"secretName": "tandem-tls"}}.items() <= next(
        v for v in envoy["volumes"] if v["name"] == "tls").items()
    # Validate with the real binary, the Secret's files standing in as a self-signed pair.
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=tandem", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    suite = make_suite_certificates(tmp_path / "suite-tls")  # the suite's Secret, likewise
    local = bootstrap.replace(f"{TLS_DIR}/tls.crt", str(cert)).replace(
        f"{TLS_DIR}/tls.key", str(key)).replace(SUITE_TLS_DIR, str(suite))
    path = tmp_path / "envoy.yaml"
    path.write_text(local)
    result = subprocess.run([str(find_envoy()), "--mode", "validate", "-c", str(path),
                             "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="decode or both"):
        K8sOptions(image="x", prefill=2, decode=0)
    with pytest.raises(ValueError, match="negative"):
        K8sOptions(image="x", prefill=-1)
    with pytest.raises(ValueError, match="whole number of CPUs.*'1500m'"):
        K8sOptions(image="x", replica_cpu="1500m", exclusive_cpus=True)


def test_exclusive_cpus_make_replica_pods_guaranteed() -> None:
    """Guaranteed QoS: every container's CPU and memory limits equal its requests."""
    for exclusive in (False, True):
        objects = render_k8s_manifests(K8sOptions(image="x", replica_cpu="3",
                                                  exclusive_cpus=exclusive))
        for role in ("prefill", "decode"):
            resources = by_kind(objects, "Deployment")[f"tandem-{role}"][
                "spec"]["template"]["spec"]["containers"][0]["resources"]
            guaranteed = resources["limits"] == resources["requests"]
            assert guaranteed == exclusive, resources
            assert resources["requests"]["cpu"] == "3"


def test_a_tensor_parallel_replica_gets_its_devices_cpus_and_shared_memory() -> None:
    """TP=2 decode, TP=1 prefill, and the reverse: on the CPU the TP=2 pod asks for twice
    the CPUs and memory (one engine process per rank), on GPUs for two GPUs; its /dev/shm
    is a memory-backed emptyDir of a GiB per rank; its replica parses the flag."""
    def replica(options: K8sOptions, role: str) -> dict[str, Any]:
        return by_kind(render_k8s_manifests(options), "Deployment")[f"tandem-{role}"][
            "spec"]["template"]["spec"]

    cpu = K8sOptions(replica_cpu="3", replica_memory="8Gi", exclusive_cpus=True,
                     tensor_parallel_size=2, prefill_tensor_parallel_size=1)
    decode, prefill = replica(cpu, "decode"), replica(cpu, "prefill")
    resources = decode["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"] == {"cpu": "6", "memory": "16Gi"}
    assert prefill["containers"][0]["resources"]["requests"] == {"cpu": "3", "memory": "8Gi"}
    shm = {v["name"]: v for v in decode["volumes"]}["dshm"]
    assert shm["emptyDir"] == {"sizeLimit": "2Gi", "medium": "Memory"}
    args = decode["containers"][0]["args"][1:]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in prefill["containers"][0]["args"]
    parsed = replica_parser().parse_args(args)
    assert parsed.tensor_parallel_size == 2
    # The reverse (the multi-host test runs it): a TP=2 prefill pod, a TP=1 decode pod.
    reverse = K8sOptions(replica_cpu="3", replica_memory="8Gi", prefill_tensor_parallel_size=2)
    prefill, decode = replica(reverse, "prefill"), replica(reverse, "decode")
    assert prefill["containers"][0]["resources"]["requests"] == {"cpu": "6", "memory": "16Gi"}
    assert {v["name"]: v for v in prefill["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "2Gi"
    assert {v["name"]: v for v in decode["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"
    args = prefill["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in decode["containers"][0]["args"]
    gpu = replica(K8sOptions(gpus=1, tensor_parallel_size=4), "decode")
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    with pytest.raises(ValueError, match="one GPU per tensor-parallel rank"):
        K8sOptions(gpus=2, tensor_parallel_size=4)


def test_replicas_and_picker_parse_their_args_and_agree_on_the_template() -> None:
    """The rendered args are what ``tandem serve`` and ``tandem picker`` accept: the model
    settings reach both (the picker renders chats and hashes an adapter's prompts as the
    replicas do, to route them)."""
    settings = ModelSettings(chat_template="/models/llama/chat.jinja",
                             tool_call_parser="hermes", generation_config="vllm",
                             override_generation_config={"top_p": 0.9},
                             lora_modules={"sql": "/models/sql-lora", "chat": "/models/c"},
                             max_loras=2, max_lora_rank=16)
    objects = render(model_settings=settings)
    deployments = by_kind(objects, "Deployment")
    replica_args = deployments["tandem-decode"]["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert replica_args[0] == "serve"
    engine = parsed_replica(replica_args[1:]).engine
    assert engine.model_settings == settings
    picker_args = deployments["tandem-epp"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert picker_args[0] == "picker"
    assert parsed_picker(picker_args[1:]).model_settings == (
        settings)


def _container_args(objects: list[dict[str, Any]], deployment: str) -> list[str]:
    return list(by_kind(objects, "Deployment")[deployment]["spec"]["template"]["spec"][
        "containers"][0]["args"])


def test_several_served_model_names_reach_every_replica(tmp_path: Path) -> None:
    """``--served-model-name A B`` as ``tandem serve`` takes it (vLLM's: the first names the
    model, the others are aliases), on every replica; the picker takes none (it tells an
    adapter's requests by the adapter's name)."""
    out = tmp_path / "manifests"
    assert render_main(["k8s", "--prefill", "1", "--decode", "2", "--served-model-name",
                        "llama-3-8b", "llama", "-o", str(out)]) == 0
    objects = [yaml.safe_load(path.read_text()) for path in sorted(out.iterdir())]
    for role in ("prefill", "decode"):
        args = _container_args(objects, f"tandem-{role}")
        assert args[0] == "serve"
        assert replica_parser().parse_args(_mounted(args[1:])).served_model_name == [
            "llama-3-8b", "llama"]
        assert parsed_replica(args[1:]).served_model_name == ["llama-3-8b", "llama"]
    picker_args = _container_args(objects, "tandem-epp")
    assert "--served-model-name" not in picker_args
    assert parsed_picker(picker_args[1:]).model == IMAGE_DEFAULT_MODEL
    # None given: the replicas default to the model directory's name.
    default_args = _container_args(render(), "tandem-decode")
    assert replica_parser().parse_args(_mounted(default_args[1:])).served_model_name is None
    with pytest.raises(ValueError, match="must not be empty"):
        render(served_model_names=("llama", " "))
    with pytest.raises(ValueError, match="also names a LoRA adapter"):
        render(served_model_names=("sql",),
               model_settings=ModelSettings(lora_modules={"sql": "/models/sql-lora"}))


def test_cli_writes_one_file_per_object(tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "render", "k8s", "--image", "img:1", "--model",
         "/models/m", "--prefill", "1", "--decode", "2", "--tls-secret", "tls", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert "inferencepool-tandem.yaml" in files and "httproute-tandem.yaml" in files
    assert len(files) == 15  # 4 Deployments with a PDB each, 4 Services, ConfigMap, 2 CRs
    decode = yaml.safe_load((out / "deployment-tandem-decode.yaml").read_text())
    assert decode["spec"]["replicas"] == 2


def test_api_keys_come_from_a_secret_through_an_init_container(tmp_path: Path) -> None:
    objects = render(api_key_secret="tandem-keys", tls_secret="tandem-tls")
    api = ApiClient()
    envoy = by_kind(objects, "Deployment")["tandem-envoy"]
    model = api._ApiClient__deserialize(envoy, "V1Deployment")  # type: ignore[attr-defined]
    assert api.sanitize_for_serialization(model) == envoy
    pod = envoy["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == "registry.example/tandem:0.1"
    assert {"name": "api-keys", "secret": {"secretName": "tandem-keys"}} in pod["volumes"]
    bootstrap = by_kind(objects, "ConfigMap")["tandem-envoy"]["data"]["envoy.yaml"]
    assert "credentials" not in bootstrap  # the keys never sit in the ConfigMap
    # Run the init container's command here, the volumes standing in as local paths.
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    local = {mounts["config"]: tmp_path / "template", mounts["api-keys"]: tmp_path / "keys",
             mounts["keyed-config"]: tmp_path / "keyed"}
    for directory in local.values():
        directory.mkdir()
    (local[mounts["config"]] / "envoy.yaml").write_text(bootstrap)
    (local[mounts["api-keys"]] / "api-keys").write_text("first-key\nsecond-key\n")
    argv = list(init["command"])
    for mount, directory in local.items():
        argv = [arg.replace(mount, str(directory)) for arg in argv]
    assert argv[:3] == ["tandem", "render", "envoy"]
    result = subprocess.run([sys.executable, "-m", "deploy.cli", *argv[1:]], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    keyed_path = local[mounts["keyed-config"]] / "envoy.yaml"
    assert keyed_path.stat().st_mode & 0o077 == 0  # readable by its owner only
    keyed = yaml.safe_load(keyed_path.read_text())
    (envoy_container,) = pod["containers"]
    assert {"name": "keyed-config", "mountPath": "/etc/envoy", "readOnly": True} in \
        envoy_container["volumeMounts"]
    for listener in keyed["static_resources"]["listeners"]:  # HTTP and HTTPS
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        names = [f["name"] for f in manager["http_filters"]]
        # The key check runs before the picker is asked (and Lua before it, for its errors).
        order = [names.index(f"envoy.filters.http.{name}")
                 for name in ("lua", "api_key_auth", "ext_proc")]
        assert order == sorted(order), names
        keys = manager["http_filters"][order[1]]["typed_config"]["credentials"]
        assert [k["key"] for k in keys] == ["first-key", "second-key"]


def test_the_lora_syncer_sidecar_reads_its_config_map_from_every_replica_pod(
        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="add --allow-runtime-lora-updating"):
        K8sOptions(image="x", lora_syncer=True)
    settings = ModelSettings(allow_runtime_lora_updating=True)
    objects = render(prefill=1, decode=1, both=1, lora_syncer=True, model_settings=settings)
    api = ApiClient()
    config_map = by_kind(objects, "ConfigMap")["tandem-lora-adapters"]
    (entry, text), = config_map["data"].items()
    assert parse_wanted_adapters(text) == WantedAdapters({}, frozenset())
    for role in ("prefill", "decode", "both"):
        deployment = by_kind(objects, "Deployment")[f"tandem-{role}"]
        model = api._ApiClient__deserialize(deployment, "V1Deployment")  # type: ignore[attr-defined]
        assert api.sanitize_for_serialization(model) == deployment
        pod = deployment["spec"]["template"]["spec"]
        (syncer,) = pod["initContainers"]
        assert syncer["restartPolicy"] == "Always"  # a native sidecar: runs beside the replica
        replica = pod["containers"][0]
        assert "--allow-runtime-lora-updating" in replica["args"]
        # The command is the real CLI's: it reads the mounted ConfigMap and calls this pod's
        # replica over loopback.
        assert syncer["command"] == ["tandem"]
        args = tandem_parser().parse_args(syncer["args"])
        assert args.func.__name__ == "cmd_lora_sync"
        mount = next(m for m in syncer["volumeMounts"] if m["name"] == "lora-adapters")
        assert args.config == Path(mount["mountPath"]) / entry
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == "tandem-lora-adapters"
        assert args.target == f"127.0.0.1:{REPLICA_PORT}"
    # Without the option, no sidecar and no ConfigMap.
    plain = render(model_settings=settings)
    assert "tandem-lora-adapters" not in by_kind(plain, "ConfigMap")
    assert all("initContainers" not in d["spec"]["template"]["spec"]
               for name, d in by_kind(plain, "Deployment").items() if name != "tandem-envoy")


def test_cli_renders_the_lora_syncer_and_says_what_it_needs(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "deploy.cli", "render", "k8s", "--image", "img:1",
               "--lora-syncer", "-o", str(tmp_path)]
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "add --allow-runtime-lora-updating" in refused.stderr
    result = subprocess.run([*command, "--allow-runtime-lora-updating"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    config_map = yaml.safe_load((tmp_path / "configmap-tandem-lora-adapters.yaml").read_text())
    assert parse_wanted_adapters(config_map["data"]["configmap.yaml"]).present == {}


# --- Real schemas, unknown fields rejected ---------------------------------------------------

def _variants() -> list[list[dict[str, Any]]]:
    """The plain default render, and one with every option that adds objects or fields."""
    full = K8sOptions(image="registry.example/tandem:0.1", model="/models/llama",
                      model_pvc="llama-weights", prefill=2, decode=3, both=1, gpus=1,
                      namespace="llm", tls_secret="tandem-tls", api_key_secret="tandem-keys",
                      exclusive_cpus=True, lora_syncer=True, envoy_replicas=2,
                      model_settings=ModelSettings(allow_runtime_lora_updating=True))
    # Tensor parallelism on the CPU, prefill and decode at different sizes.
    parallel = K8sOptions(tensor_parallel_size=2, prefill_tensor_parallel_size=1,
                          exclusive_cpus=True)
    return [render_k8s_manifests(K8sOptions()), render_k8s_manifests(full),
            render_k8s_manifests(parallel)]


def test_every_object_validates_against_its_real_schema_strictly() -> None:
    kinds = set()
    for objects in _variants():
        for obj in objects:
            validate_object(obj)  # raises SchemaError naming the field
            kinds.add(obj["kind"])
    assert kinds == {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
                     "InferencePool", "HTTPRoute"}
    assert K8S_VERSIONS[0] == "1.30"


@pytest.mark.parametrize(("kind", "where"), [
    ("Deployment", ("spec", "template", "spec", "containers", 0, "securityContext")),
    ("Deployment", ("spec", "template", "spec")),
    ("PodDisruptionBudget", ("spec",)),
    ("Service", ("spec", "ports", 0)),
    ("InferencePool", ("spec", "endpointPickerRef")),
    ("InferencePool", ("metadata",)),
    ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0)),
    ("HTTPRoute", ("spec", "rules", 0, "matches", 0, "path")),
    ("HTTPRoute", ()),
])
def test_the_validation_rejects_an_unknown_field(kind: str, where: tuple[Any, ...]) -> None:
    """The check above can fail: a field the API does not define, anywhere, is refused."""
    obj = next(o for o in render_k8s_manifests(K8sOptions()) if o["kind"] == kind)
    node: Any = obj
    for key in where:
        node = node[key]
    node["unknownField"] = "x"
    with pytest.raises(SchemaError, match="unknownField"):
        validate_object(obj)


def test_a_wrong_type_or_value_is_rejected_too() -> None:
    objects = render_k8s_manifests(K8sOptions())
    pool = by_kind(objects, "InferencePool")["tandem"]
    pool["spec"]["appProtocol"] = "grpc"  # not in the CRD's enum
    with pytest.raises(SchemaError, match="appProtocol"):
        validate_object(pool)
    budget = next(o for o in objects if o["kind"] == "PodDisruptionBudget")
    budget["spec"]["unhealthyPodEvictionPolicy"] = 3
    with pytest.raises(SchemaError, match="unhealthyPodEvictionPolicy"):
        validate_object(budget)


def _yaml_anchors(text: str) -> list[str]:
    """Anchors and aliases in a YAML text, from the parser's events."""
    return [f"{type(event).__name__} {event.anchor}" for event in yaml.parse(text)
            if getattr(event, "anchor", None) is not None]


def test_written_manifests_and_the_envoy_bootstrap_hold_no_yaml_anchors(tmp_path: Path) -> None:
    """Labels are shared by a Deployment's selector and template (the same dict): PyYAML would
    write them as &id001 / *id001."""
    for index, objects in enumerate(_variants()):
        for path in write_manifests(objects, tmp_path / str(index)):
            text = path.read_text()
            assert _yaml_anchors(text) == [], path.name
            obj = yaml.safe_load(text)
            for value in (obj.get("data") or {}).values():  # the bootstrap in the ConfigMap
                assert _yaml_anchors(value) == [], path.name
    assert _yaml_anchors("a: &x {b: 1}\nc: *x\n") == ["MappingStartEvent x", "AliasEvent x"]


def test_the_cli_output_passes_the_kubernetes_validate_command_strictly(tmp_path: Path) -> None:
    """The command line tool itself, on the files ``tandem render k8s`` writes."""
    out = tmp_path / "manifests"
    subprocess.run([sys.executable, "-m", "deploy.cli", "render", "k8s", "--prefill", "2",
                    "--api-key-secret", "keys", "-o", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=60)
    core = sorted(str(p) for p in out.iterdir()
                  if not p.name.startswith(("inferencepool-", "httproute-")))
    assert len(core) == 13
    validator = Path(sys.executable).with_name("kubernetes-validate")
    for version in K8S_VERSIONS:
        result = subprocess.run([str(validator), "--strict", "--quiet", "-k", version, *core],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "WARN" not in result.stdout  # every kind had a schema


# --- Security ------------------------------------------------------------------------------

def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: d["spec"]["template"]["spec"] for name, d in by_kind(objects, "Deployment").items()}


def test_every_pod_and_container_meets_the_restricted_pod_security_standard() -> None:
    """Kubernetes' Pod Security Standards, ``restricted`` profile, rule by rule; and a
    read-only root filesystem everywhere, writable only through emptyDirs."""
    allowed_volumes = {"configMap", "emptyDir", "persistentVolumeClaim", "secret"}
    for objects in _variants():
        for name, pod in _pods(objects).items():
            context = pod["securityContext"]
            uid = ENVOY_UID if name.endswith("-envoy") else TANDEM_UID
            assert context["runAsNonRoot"] is True and context["runAsUser"] == uid > 0, name
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            assert pod["automountServiceAccountToken"] is False
            assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
            for volume in pod["volumes"]:
                assert set(volume) - {"name"} <= allowed_volumes, volume
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                sc = container["securityContext"]
                assert sc["runAsNonRoot"] is True and sc["privileged"] is False
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"] == {"drop": ["ALL"]}
                assert sc["readOnlyRootFilesystem"] is True
                assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
                assert "runAsUser" not in sc  # the pod's user: Envoy reads what the init wrote
                assert not any(p.get("hostPort") for p in container.get("ports", []))


def test_what_a_process_writes_lands_in_a_bounded_empty_dir() -> None:
    """HOME and TMPDIR are /tmp, an emptyDir in every pod; the replicas' and picker's cache
    (the CPU kernel they build) and /dev/shm too; every mount names a volume of its pod."""
    for objects in _variants():
        for name, pod in _pods(objects).items():
            volumes = {v["name"]: v for v in pod["volumes"]}
            for volume in volumes.values():
                if "emptyDir" in volume:
                    assert volume["emptyDir"]["sizeLimit"], (name, volume)
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                assert set(mounts.values()) <= set(volumes), name
                assert "emptyDir" in volumes[mounts["/tmp"]], (name, container["name"])
                writable = [path for path, volume in mounts.items()
                            if "emptyDir" in volumes[volume]]
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                if container["image"] != "envoyproxy/envoy:v1.40.0":
                    assert env["HOME"] == env["TMPDIR"] == "/tmp"
                if container["name"] in ("replica", "endpoint-picker"):
                    assert env["TANDEM_CACHE_DIR"] in writable
                    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_the_envoy_pod_runs_as_envoys_user_and_its_init_container_writes_for_it() -> None:
    objects = _variants()[1]
    pod = _pods(objects)["tandem-envoy"]
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == 101
    (init,) = pod["initContainers"]
    assert init["image"] == "registry.example/tandem:0.1"  # Tandem's image, Envoy's user
    keyed = next(m for m in init["volumeMounts"] if m["name"] == "keyed-config")
    assert not keyed.get("readOnly")


# --- Availability and stopping -------------------------------------------------------------

def test_every_deployment_has_a_disruption_budget_selecting_exactly_its_pods() -> None:
    for objects in _variants():
        budgets = by_kind(objects, "PodDisruptionBudget")
        deployments = by_kind(objects, "Deployment")
        assert set(budgets) == set(deployments)
        for name, deployment in deployments.items():
            spec = budgets[name]["spec"]
            assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec
            assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert spec["selector"]["matchLabels"] == labels
            # No other Deployment's pods match (roles differ by their role label).
            for other_name, other in deployments.items():
                other_labels = other["spec"]["template"]["metadata"]["labels"]
                matches = spec["selector"]["matchLabels"].items() <= other_labels.items()
                assert matches == (other_name == name), (name, other_name)


def test_pods_spread_over_nodes_and_zones_as_a_preference() -> None:
    for name, pod in _pods(render(prefill=2, decode=4)).items():
        constraints = pod["topologySpreadConstraints"]
        assert [c["topologyKey"] for c in constraints] == [
            "kubernetes.io/hostname", "topology.kubernetes.io/zone"]
        for constraint in constraints:
            assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"
            assert constraint["maxSkew"] == 1
            assert constraint["matchLabelKeys"] == ["pod-template-hash"]
            assert constraint["labelSelector"]["matchLabels"] == _deployment_labels(
                render(prefill=2, decode=4), name)


def _deployment_labels(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    return by_kind(objects, "Deployment")[name]["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("drain", [30, 120])
def test_a_stopping_replica_gets_its_whole_drain_before_sigkill(drain: int) -> None:
    """preStop sleep, then SIGTERM, on which the replica drains for --shutdown-grace (as its
    own parser reads it) and stops; the grace period covers all of it with a margin."""
    for role in ("prefill", "decode"):
        pod = _pods(render(drain_seconds=drain))[f"tandem-{role}"]
        (container,) = pod["containers"]
        args = container["args"]
        parsed = parsed_replica(args[1:])
        assert parsed.shutdown_grace_s == drain
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop == PRE_STOP_S
        final_grace_s = 1.0  # services/replica/server.py: after the drain, unary calls
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + final_grace_s + 10
    envoy = _pods(render(drain_seconds=drain))["tandem-envoy"]
    envoy_sleep = envoy["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert envoy_sleep == drain  # Envoy stops at once on SIGTERM: its drain is the sleep
    assert envoy["terminationGracePeriodSeconds"] > envoy_sleep
    picker = _pods(render(drain_seconds=drain))["tandem-epp"]
    assert picker["terminationGracePeriodSeconds"] > PRE_STOP_S


def test_the_endpoint_picker_runs_two_replicas_by_default() -> None:
    """Active-active: each picker replica watches every replica itself (docs/kubernetes.md)."""
    picker = by_kind(render_k8s_manifests(K8sOptions()), "Deployment")["tandem-epp"]
    assert picker["spec"]["replicas"] == 2
    with pytest.raises(ValueError, match="at least one replica"):
        K8sOptions(picker_replicas=0)


# --- Addresses and ports -------------------------------------------------------------------

def test_replicas_advertise_their_pod_ip_for_kv_and_prefill_listens_on_a_declared_port() -> None:
    """``--kv-host $(POD_IP)``: the kubelet expands it from the downward API; the replica's
    own parser then takes it as the advertised KV address (never loopback)."""
    for role in ("prefill", "decode", "both"):
        (container,) = _pods(render(prefill=1, decode=1, both=1))[f"tandem-{role}"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        args = [arg.replace("$(POD_IP)", "198.18.0.7").replace("$(POD_NAME)", "pod-0")
                for arg in container["args"]]
        assert container["args"][container["args"].index("--kv-host") + 1] == "$(POD_IP)"
        kv = parsed_replica(args[1:]).engine.kv_transfer
        assert kv.host == "198.18.0.7"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if role == "prefill":
            assert kv.port == REPLICA_KV_PORT == ports["kv"]
        else:  # a decode replica pulls; it opens no KV listener
            assert "kv" not in ports and "--kv-port" not in args


def test_every_port_a_process_listens_on_is_a_declared_container_port() -> None:
    """Read from the args the real parsers take: gRPC and metrics of replicas and picker."""
    pods = _pods(render(prefill=1, decode=1, tls_secret="tls"))
    for name in ("tandem-prefill", "tandem-decode"):
        (container,) = pods[name]["containers"]
        options = parsed_replica(container["args"][1:])
        declared = {p["containerPort"] for p in container["ports"]}
        assert {options.port, options.metrics_port} <= declared
        assert {options.port, options.metrics_port} == {REPLICA_PORT, REPLICA_METRICS_PORT}
    (picker,) = pods["tandem-epp"]["containers"]
    parsed = parsed_picker(picker["args"][1:])
    assert {p["containerPort"] for p in picker["ports"]} == {parsed.port, parsed.metrics_port}
    assert (parsed.port, parsed.metrics_port) == (PICKER_PORT, PICKER_METRICS_PORT)
    (envoy,) = pods["tandem-envoy"]["containers"]
    assert {p["containerPort"] for p in envoy["ports"]} == {ENVOY_HTTP_PORT, ENVOY_HTTPS_PORT}


# --- API keys on gRPC, the image -----------------------------------------------------------

def test_with_api_keys_grpc_calls_through_the_gateway_go_through_envoys_key_check() -> None:
    """The Gateway's own route to the InferencePool checks no key: with keys required,
    ``tandem.v1.Generation`` calls go to Envoy (h2c, which takes gRPC) like the HTTP ones."""
    keyed = by_kind(render(api_key_secret="keys"), "HTTPRoute")["tandem"]
    grpc_rule, http_rule = keyed["spec"]["rules"]
    assert grpc_rule["matches"][0]["path"]["value"] == "/tandem.v1.Generation/"
    assert grpc_rule["backendRefs"] == http_rule["backendRefs"] == [
        {"name": "tandem-openai", "port": ENVOY_HTTP_PORT}]
    service = by_kind(render(api_key_secret="keys"), "Service")["tandem-openai"]
    http = next(p for p in service["spec"]["ports"] if p["port"] == ENVOY_HTTP_PORT)
    assert http["appProtocol"] == "kubernetes.io/h2c"
    open_route = by_kind(render(), "HTTPRoute")["tandem"]
    assert open_route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"


def test_the_default_image_and_model_are_the_ones_make_image_builds() -> None:
    """Without --image and --model, every Tandem container runs ``make image``'s tag and the
    default model the image converted at build time (tests/image checks it is there)."""
    objects = render_k8s_manifests(K8sOptions())
    for name, pod in _pods(objects).items():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            if name != "tandem-envoy":
                assert container["image"] == DEFAULT_IMAGE
                args = container["args"]
                assert args[args.index("--model") + 1] == (
                    "/opt/tandem/cache/models/SmolLM2-135M-Instruct")


def _mounts_suite_tls(deployment: dict) -> bool:
    spec = deployment["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    return any(m["mountPath"] == SUITE_TLS_DIR and secrets.get(m["name"]) == "tandem-suite-tls"
               for c in spec["containers"] for m in c.get("volumeMounts", []))


def test_the_suites_pods_speak_mutual_tls_by_default() -> None:
    deployments = by_kind(render(prefill=1, decode=1), "Deployment")
    for name in ("tandem-prefill", "tandem-decode", "tandem-epp", "tandem-envoy"):
        assert _mounts_suite_tls(deployments[name]), name
    for name in ("tandem-prefill", "tandem-decode", "tandem-epp"):
        args = deployments[name]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--tls-dir") + 1] == SUITE_TLS_DIR, name
    envoy = yaml.safe_load(by_kind(render(prefill=1, decode=1), "ConfigMap")[
        "tandem-envoy"]["data"]["envoy.yaml"])
    picked = next(c for c in envoy["static_resources"]["clusters"]
                  if c["type"] == "ORIGINAL_DST")
    assert SUITE_TLS_DIR in str(picked["transport_socket"])
    plain = by_kind(render(prefill=1, decode=1, suite_tls=False), "Deployment")
    for name, deployment in plain.items():
        assert not _mounts_suite_tls(deployment), name
        args = deployment["spec"]["template"]["spec"]["containers"][0].get("args", [])
        assert "--tls-dir" not in args
