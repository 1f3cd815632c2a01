"""Kubernetes P/D across hosts: the rendered pods, each on its own "host", behind real Envoy.

`tandem render k8s` writes the manifests; each pod of the prefill, decode, endpoint-picker and
Envoy Deployments runs as the process its container names (``tests.k8s_pods``: the exact
command, args and environment, with what a kubelet substitutes), each in its own network
namespace with its own address (``tests.netns``), so loopback shortcuts fail: a replica that
advertised 127.0.0.1 for its KV blocks, or bound only loopback, would be unreachable. Service
names resolve to the pods' addresses as cluster DNS would. The test is the client outside the
cluster: the `openai` SDK over HTTP and the gRPC SDK, both through Envoy.

The prefill pod is a tensor-parallel replica of 2 ranks (``--prefill-tensor-parallel-size
2``: a rank 0 and a worker process in the pod), the decode pod one rank: its KV moves per
rank across hosts, the decode pod reading each prefill rank's heads over TCP.

Checked: greedy text equal to the engine's (itself checked against Hugging Face); the
prefill pod says it has 2 ranks (``GetInfo``); prompts the picker sends to P/D really run on
the prefill pod and their KV moves to the decode pod (its ``tandem:kv_transfer_bytes_total``
grows, no fallback: a TP=2 prefill's KV can only arrive per rank); killing the prefill pod's
process makes the next request fall back (counted) and, once the picker has seen it go,
requests route around it.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.cli import main as tandem_main
from deploy.local_ca import make_suite_certificates
from engine_common.config import CacheConfig, EngineConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from services.suite_tls import SuiteTls
from services.suite_tls import channel as suite_channel
from tandem import Client
from tests.k8s_pods import find, pod_command, read_manifests
from tests.netns import Host, HostLab, NetnsUnavailable

NAME = "tandem"
# Pod -> the Deployment it belongs to (one replica each).
PODS = {"prefill": f"{NAME}-prefill", "decode": f"{NAME}-decode", "epp": f"{NAME}-epp",
        "envoy": f"{NAME}-envoy"}
REPLICA_PORT, METRICS_PORT, PICKER_PORT, HTTP_PORT = 50051, 9400, 9002, 8080
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


@dataclass
class Cluster:
    hosts: dict[str, Host]
    tls: SuiteTls | None
    logs: Path

    def address(self, pod: str) -> str:
        return self.hosts[pod].address

    def metric(self, pod: str, name: str) -> float:
        url = f"http://{self.address(pod)}:{METRICS_PORT}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(float(m.group(1)) for m in re.finditer(
            rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.address('envoy')}:{HTTP_PORT}/v1",
                             api_key="unused", max_retries=0, timeout=120)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.logs.glob("*.log")))


MODEL_CLAIM = "tiny-models"  # the PersistentVolumeClaim the model is read from


def _render(model_dir: Path, out: Path) -> None:
    assert tandem_main([
        "render", "k8s", "-o", str(out), "--name", NAME, "--prefill", "1", "--decode", "1",
        "--model-pvc", MODEL_CLAIM, "--model", f"/models/{model_dir.name}",
        "--served-model-name", "tiny", "--kv-cache-memory", "16MiB",
        "--prefill-tensor-parallel-size", "2"]) == 0


def _service_names(objects: list[dict], hosts: dict[str, Host]) -> dict[str, list[str]]:
    """Each Service's names (short and cluster-qualified) -> the addresses of the pods its
    selector picks, as cluster DNS answers a headless Service."""
    names: dict[str, list[str]] = {}
    labels = {pod: find(objects, "Deployment", deployment)["spec"]["template"]["metadata"][
        "labels"] for pod, deployment in PODS.items()}
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"].get("selector", {}).items()
        picked = [hosts[pod].address for pod in PODS if selector <= labels[pod].items()]
        name, namespace = service["metadata"]["name"], service["metadata"].get("namespace",
                                                                                "default")
        for alias in (name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
                      f"{name}.{namespace}.svc.cluster.local"):
            names[alias] = picked
    return names


def _serving(target: str, tls: SuiteTls | None) -> bool:
    with suite_channel(target, tls) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def _wait(cluster: Cluster, what: str, ready, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} not ready in time\n{cluster.tails()}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("k8s-multihost")
    _render(tiny_llama_dir, work / "manifests")
    objects = read_manifests(work / "manifests")
    secrets = {secret_name: make_suite_certificates(work / "suite-tls")
               for secret_name in _secret_names(objects)}
    volumes = {**secrets, MODEL_CLAIM: tiny_llama_dir.parent}
    try:
        lab = HostLab()
    except NetnsUnavailable as error:
        pytest.fail(f"this test needs Linux network namespaces (one per pod): {error}")
    with lab:
        hosts = {pod: lab.add_host(pod) for pod in PODS}
        lab.resolve(_service_names(objects, hosts))
        logs = work / "logs"
        logs.mkdir()
        tls = SuiteTls.load(next(iter(secrets.values()))) if secrets else None
        cluster = Cluster(hosts, tls, logs)
        # Every pod at once, as a cluster starts them: the picker and Envoy retry their
        # upstreams until those answer, and the processes' imports overlap.
        for pod in PODS:
            _start_pod(cluster, objects, pod, work, volumes)
        for replica in ("prefill", "decode"):
            _wait(cluster, replica, lambda r=replica: _serving(
                f"{cluster.address(r)}:{REPLICA_PORT}", tls))
        _wait(cluster, "envoy", lambda: _http_answers(
            f"http://{cluster.address('envoy')}:{HTTP_PORT}/v1/models"))
        _wait(cluster, "the picker's view of both replicas", lambda: _routes_pd(cluster))
        yield cluster


def _secret_names(objects: list[dict]) -> set[str]:
    return {volume["secret"]["secretName"] for o in objects if o["kind"] == "Deployment"
            for volume in o["spec"]["template"]["spec"].get("volumes", []) if "secret" in volume}


def _start_pod(cluster: Cluster, objects: list[dict], pod: str, work: Path,
               volumes: dict[str, Path]) -> None:
    host = cluster.hosts[pod]
    command = pod_command(find(objects, "Deployment", PODS[pod]), objects,
                          pod_name=f"{NAME}-{pod}-0", pod_ip=host.address,
                          workdir=work / "pods" / pod, given=volumes)
    host.spawn(command.argv, command.env, cluster.logs / f"{pod}.log")


def _routes_pd(cluster: Cluster) -> bool:
    """The picker has both replicas in rotation: a long prompt gets a P/D pick."""
    try:
        url = f"http://{cluster.address('epp')}:9090/metrics"
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return False
    healthy = re.findall(r'^tandem:gateway_replicas\{[^}]*healthy="true"[^}]*\} (\S+)$',
                         text, re.M)
    return sum(float(v) for v in healthy) >= 2


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(tiny_llama_dir),
                            cache=CacheConfig(num_gpu_blocks_override=256)))


def _prompt(seed: int, words: int = 60) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


def _expected(offline: LLM, prompt: str, max_tokens: int) -> str:
    [result] = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))
    return result.text


def test_pd_through_envoy_and_the_picker_across_hosts(cluster: Cluster, offline: LLM) -> None:
    with suite_channel(f"{cluster.address('prefill')}:{REPLICA_PORT}", cluster.tls) as ch:
        info = engine_pb2_grpc.EngineStub(ch).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
    assert (info.tensor_parallel_size, info.kv_layout.tensor_parallel_size) == (2, 2)
    before = {name: cluster.metric(pod, name) for pod, name in (
        ("decode", "tandem:kv_transfer_bytes_total"),
        ("decode", "tandem:kv_transfer_fallbacks_total"),
        ("prefill", "vllm:prompt_tokens_total"))}
    client = cluster.openai()
    for seed in range(3):
        prompt = _prompt(seed)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                        temperature=0)
        assert got.choices[0].text == _expected(offline, prompt, 6)
    with Client(f"{cluster.address('envoy')}:{HTTP_PORT}", timeout=120) as grpc_client:
        prompt = _prompt(7)
        assert grpc_client.complete(prompt, max_tokens=5, temperature=0.0).text == _expected(
            offline, prompt, 5)
    assert cluster.metric("decode", "tandem:kv_transfer_bytes_total") > before[
        "tandem:kv_transfer_bytes_total"], cluster.tails()
    assert cluster.metric("decode", "tandem:kv_transfer_fallbacks_total") == before[
        "tandem:kv_transfer_fallbacks_total"], cluster.tails()
    # The prefill pod computed those prompts (60 words each, more tokens than that), and
    # the decode pod told the picker so, which credits the prefill pod's prefix index.
    assert cluster.metric("prefill", "vllm:prompt_tokens_total") >= before[
        "vllm:prompt_tokens_total"] + 4 * 60
    assert _picker_metric(cluster, "tandem:gateway_prefill_outcomes_total", "remote") >= 4


def test_an_unreachable_prefill_pod_falls_back_and_a_dead_one_is_routed_around(
        cluster: Cluster, offline: LLM) -> None:
    client = cluster.openai()
    fallbacks = cluster.metric("decode", "tandem:kv_transfer_fallbacks_total")
    # A partition: the decode pod cannot reach the prefill pod, which the picker still sees
    # healthy and names: the decode pod recomputes the prompt, counts it and says so.
    cluster.hosts["decode"].cut_off(cluster.address("prefill"))
    try:
        prompt = _prompt(11)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                        temperature=0)
        assert got.choices[0].text == _expected(offline, prompt, 4)
    finally:
        cluster.hosts["decode"].cut_off(cluster.address("prefill"), cut=False)
    assert cluster.metric("decode", "tandem:kv_transfer_fallbacks_total") == fallbacks + 1
    assert _picker_metric(cluster, "tandem:gateway_prefill_outcomes_total", "fallback") == 1
    # The prefill pod's process dies: the picker stops naming it, no request falls back.
    cluster.hosts["prefill"].kill()
    _wait(cluster, "the picker noticing the dead prefill pod", lambda: not _routes_pd(cluster),
          timeout=30)
    for seed in (12, 13):
        prompt = _prompt(seed)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                        temperature=0)
        assert got.choices[0].text == _expected(offline, prompt, 4)
    assert cluster.metric("decode", "tandem:kv_transfer_fallbacks_total") == fallbacks + 1


def _picker_metric(cluster: Cluster, name: str, outcome_prefix: str) -> float:
    url = f"http://{cluster.address('epp')}:9090/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(value) for outcome, value in re.findall(
        rf'^{re.escape(name)}\{{outcome="([^"]*)"\}} (\S+)$', text, re.M)
        if outcome.startswith(outcome_prefix))
