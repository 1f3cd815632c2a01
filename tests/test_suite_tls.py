"""The suite's mutual TLS over real processes: a replica answers suite members only, a decode
replica pulls KV only from suite members, and the gateway reaches its replicas through it.

Two throwaway certificate authorities (``deploy.local_ca``): the suite's, and an impostor's
that signs a certificate for the very same name. Unauthenticated callers (plaintext, TLS
without a client certificate, the impostor's certificate) are refused at the handshake, on
the public and the internal API alike (they share the replica's port).
"""

from __future__ import annotations

import random
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.local_ca import make_suite_certificates
from engine_common.config import CacheConfig, EngineConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from services.replica.callers import CallerScopes
from services.suite_tls import CHANNEL_NAME_OPTION, SuiteTls, channel
from tandem import Client
from tests.replica_process import free_port, gateway_before, start_replicas

HEALTH_PORT = free_port()
ARGS = ["--num-kv-blocks", "128", "--max-num-seqs", "8", "--dtype", "float32"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    suite = make_suite_certificates(tmp_path_factory.mktemp("suite-tls"))
    impostor = make_suite_certificates(tmp_path_factory.mktemp("impostor-tls"))
    return suite, impostor


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            certs: tuple[Path, Path]):
    suite, impostor = certs
    replicas = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("tls-logs"), {
        "prefill": ["--role", "prefill", "--tls-dir", str(suite),
                    "--health-port", str(HEALTH_PORT), *ARGS],
        "decode": ["--role", "decode", "--tls-dir", str(suite), "--kv-pull-timeout", "5", *ARGS],
        "impostor": ["--role", "prefill", "--tls-dir", str(impostor), *ARGS],
    })
    yield replicas
    for replica in replicas.values():
        replica.kill()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                            cache=CacheConfig(num_gpu_blocks_override=128)))


def get_info(ch: grpc.Channel) -> epb.EngineInfo:
    return epb_grpc.EngineStub(ch).GetInfo(epb.GetInfoRequest(), timeout=10)


def test_a_replica_answers_suite_members_only(cluster, certs) -> None:
    suite, impostor = certs
    target = cluster["prefill"].target
    with channel(target, SuiteTls.load(suite)) as member:
        assert get_info(member).role == "prefill"
    tls = SuiteTls.load(suite)
    strangers = {
        "plaintext": grpc.insecure_channel(target),
        "no client certificate": grpc.secure_channel(
            target, grpc.ssl_channel_credentials(tls.ca), options=[CHANNEL_NAME_OPTION]),
        "another CA's certificate": channel(target, SuiteTls.load(impostor)),
    }
    for what, ch in strangers.items():
        with ch:
            with pytest.raises(grpc.RpcError) as refused:
                get_info(ch)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, what
            with pytest.raises(grpc.RpcError):  # the public API shares the port
                pb_grpc.GenerationStub(ch).ListModels(pb.ListModelsRequest(), timeout=10)


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def generate(target: str, tls: SuiteTls, prompt: list[int], peer: str) -> tuple[list[int], str]:
    request = epb.GenerateRequest(
        request_id=f"tls-{random.randrange(10**9)}", prompt_token_ids=prompt, prefill_peer=peer,
        sampling_params=epb.SamplingParams(max_tokens=6, min_tokens=6, temperature=0),
        output_options=epb.OutputOptions(return_token_ids=True))
    with channel(target, tls) as ch:
        responses = list(epb_grpc.EngineStub(ch).Generate(request, timeout=60))
    reason = next(r.kv_transfer.fallback_reason for r in responses if r.HasField("kv_transfer"))
    return [t for r in responses for t in r.new_token_ids], reason


def test_kv_moves_between_suite_members_and_never_from_an_impostor(cluster, certs, offline):
    suite = SuiteTls.load(certs[0])
    decode = cluster["decode"]
    prompt = list(range(7, 60))
    [want] = [r.token_ids for r in offline.generate([prompt], SamplingParams(
        temperature=0, max_tokens=6, min_tokens=6))]
    tokens, reason = generate(decode.target, suite, prompt, cluster["prefill"].target)
    assert (tokens, reason) == (want, "")
    assert metric(decode.metrics_url, "tandem:kv_transfer_bytes_total") > 0
    before = metric(decode.metrics_url, "tandem:kv_transfer_fallbacks_total")
    tokens, reason = generate(decode.target, suite, prompt, cluster["impostor"].target)
    assert tokens == want and reason  # recomputed here: the impostor's handshake failed
    assert metric(decode.metrics_url, "tandem:kv_transfer_fallbacks_total") == before + 1
    assert metric(cluster["impostor"].metrics_url, "vllm:prompt_tokens_total") == 0


def test_the_gateway_reaches_its_replicas_over_mutual_tls(cluster, certs, tiny_llama_dir,
                                                           tmp_path_factory, offline) -> None:
    suite = certs[0]
    targets = [cluster["prefill"].target, cluster["decode"].target]
    with gateway_before(tiny_llama_dir, tmp_path_factory.mktemp("tls-gateway"), targets,
                        ["--tls-dir", str(suite)]) as gateway, Client(gateway) as client:
        text = client.complete("the quick brown fox", max_tokens=5, temperature=0.0).text
    [want] = offline.generate(["the quick brown fox"], SamplingParams(temperature=0,
                                                                       max_tokens=5))
    assert text == want.text


def test_one_caller_cannot_release_abort_or_outpin_another() -> None:
    scopes = CallerScopes(max_pinned_blocks=10)
    scopes.started("g-1", "198.18.0.2")
    assert scopes.abortable(["g-1", "g-unknown"], "198.18.0.3") == []
    assert scopes.abortable(["g-1"], "198.18.0.2") == ["g-1"]
    scopes.pin("p-1", "198.18.0.2", 8, lease_deadline=4e9)
    with pytest.raises(Exception, match="another caller"):
        scopes.check_release("p-1", "198.18.0.3")
    scopes.check_release("p-1", "198.18.0.2")
    with pytest.raises(Exception, match="may hold 10"):
        scopes.check_pin("198.18.0.2", 3)
    scopes.check_pin("198.18.0.3", 3)  # another caller's own budget
    scopes.pin("p-old", "198.18.0.3", 10, lease_deadline=1.0)  # a lease long over
    scopes.check_pin("198.18.0.3", 10)


def test_probes_without_a_certificate_get_health_and_nothing_else(cluster) -> None:
    """A kubelet's gRPC probe has no certificate: --health-port answers it in plaintext."""
    with grpc.insecure_channel(f"127.0.0.1:{HEALTH_PORT}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            get_info(ch)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_sdk_speaks_mutual_tls_with_a_suites_replica(cluster, certs) -> None:
    """What the LoRA syncer sidecar does (``tandem lora sync --tls-dir``): the gRPC SDK with
    the suite's files reaches a replica that refuses everyone else."""
    from tandem import TlsConfig

    with Client(cluster["decode"].target, tls=TlsConfig.from_dir(certs[0]),
                timeout=30) as client:
        assert [m.id for m in client.models()]
    with Client(cluster["decode"].target, tls=TlsConfig.from_dir(certs[1]),
                timeout=10) as impostor, pytest.raises(Exception, match="UNAVAILABLE"):
        impostor.models()
