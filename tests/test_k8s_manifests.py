"""``tandem render k8s``: every object checked against the schemas available offline.

Core and apps objects are deserialized into the ``kubernetes`` client's models (V1Deployment,
V1Service, V1ConfigMap: required fields and types enforced) and serialized back: a field the
API does not know would be dropped, so the round trip must give the rendered dict back
unchanged. The InferencePool and HTTPRoute have no models there; their published schemas'
facts are encoded below, with their sources. The Envoy bootstrap inside the ConfigMap goes
through the real ``envoy --mode validate``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient

from deploy.envoy_runner import find_envoy
from deploy.k8s import (
    PICKER_PORT,
    POOL_LABEL,
    REPLICA_PORT,
    ROLE_LABEL,
    TLS_DIR,
    K8sOptions,
    render_k8s_manifests,
)
from engine_common.config import ModelSettings
from gateway.endpoint_picker_main import build_parser as picker_parser
from gateway.endpoint_picker_main import options_from_args as picker_options
from services.replica.main import build_parser as replica_parser
from services.replica.main import options_from_args as replica_options
from tandem.cli import build_parser as tandem_parser
from tandem.lora_sync import WantedAdapters, parse_wanted_adapters

REPO = Path(__file__).resolve().parents[1]
MODELS = {"ConfigMap": "V1ConfigMap", "Service": "V1Service", "Deployment": "V1Deployment"}

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
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": REPLICA_PORT}
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
    local = bootstrap.replace(f"{TLS_DIR}/tls.crt", str(cert)).replace(
        f"{TLS_DIR}/tls.key", str(key))
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
    engine = replica_options(replica_parser().parse_args(replica_args[1:])).engine
    assert engine.model_settings == settings
    picker_args = deployments["tandem-epp"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert picker_args[0] == "picker"
    assert picker_options(picker_parser().parse_args(picker_args[1:])).model_settings == (
        settings)


def test_cli_writes_one_file_per_object(tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "render", "k8s", "--image", "img:1", "--model",
         "/models/m", "--prefill", "1", "--decode", "2", "--tls-secret", "tls", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert "inferencepool-tandem.yaml" in files and "httproute-tandem.yaml" in files
    assert len(files) == 11
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
    result = subprocess.run([sys.executable, "-m", "tandem.cli", *argv[1:]], cwd=REPO,
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
        assert names[:3] == ["envoy.filters.http.lua", "envoy.filters.http.api_key_auth",
                             "envoy.filters.http.ext_proc"]
        keys = manager["http_filters"][1]["typed_config"]["credentials"]
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
        (mount,) = syncer["volumeMounts"]
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
    command = [sys.executable, "-m", "tandem.cli", "render", "k8s", "--image", "img:1",
               "--lora-syncer", "-o", str(tmp_path)]
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "add --allow-runtime-lora-updating" in refused.stderr
    result = subprocess.run([*command, "--allow-runtime-lora-updating"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    config_map = yaml.safe_load((tmp_path / "configmap-tandem-lora-adapters.yaml").read_text())
    assert parse_wanted_adapters(config_map["data"]["configmap.yaml"]).present == {}
