"""``tandem render``: write Envoy's bootstrap or Tandem's Kubernetes manifests as YAML.

Owns the command line of both renderings and writing their files: ``render envoy`` writes one
bootstrap (to ``-o FILE`` or stdout), ``render k8s`` one file per Kubernetes object into
``-o DIR`` (``kubectl apply -f DIR``). It does not own what is rendered (``envoy_config``,
``k8s``) or the bootstrap's shared flags (``envoy_args``: ``render envoy`` takes every flag
``deploy.envoy_runner`` does that shapes the bootstrap, with a pod's defaults).

    tandem render envoy --upstream 127.0.0.1:50051 --http-port 8080 -o envoy.yaml
    tandem render k8s --image registry.example/tandem:0.1 --model /models/llama \\
        --model-pvc llama-weights --prefill 2 --decode 4 --tls-secret tandem-tls -o deploy/out

Manifests and the bootstrap are written without YAML anchors (``yaml_text``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from deploy.envoy_args import EnvoyArgDefaults, add_envoy_args, bootstrap_from_args
from deploy.envoy_config import TlsFiles, dump_bootstrap, read_api_keys, with_api_keys
from deploy.k8s import DEFAULT_IMAGE, K8sOptions, render_k8s_manifests
from deploy.yaml_text import dump_yaml
from gateway.tier_weights import TIER_WEIGHTS_HELP, tier_weights_argument
from services.help_format import DefaultsHelpFormatter
from services.model_settings import add_model_settings_args, model_settings_from_args
from services.replica.engine_flags import positive_int


def _add_envoy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("envoy", formatter_class=DefaultsHelpFormatter,
                       help="Envoy's bootstrap (OpenAI HTTP -> tandem.v1 gRPC)")
    # The flags deploy.envoy_runner takes, with a pod's defaults: every interface, admin 9901.
    target = add_envoy_args(p, EnvoyArgDefaults(
        http_port=8080, listen_host="0.0.0.0", admin_port=9901,
        admin_help="admin interface on 127.0.0.1 (default: %(default)s)"))
    target.add_argument("--bootstrap", type=Path, metavar="FILE",
                        help="a bootstrap rendered before, to add --api-key-file's keys to "
                             "(how Kubernetes pods add keys from a Secret)")
    p.add_argument("--inline-descriptor", action="store_true",
                   help="embed the descriptor set in the bootstrap (one self-contained file)")
    p.add_argument("--tls-cert", help="PEM certificate chain: also serve HTTPS")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--https-port", type=int, default=8443, help="(default: %(default)s)")
    p.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")


def _add_k8s(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    defaults = K8sOptions()
    p = sub.add_parser("k8s", formatter_class=DefaultsHelpFormatter,
                       help="Kubernetes manifests: replicas, picker, Envoy, "
                            "InferencePool, HTTPRoute")
    p.add_argument("--image", default=DEFAULT_IMAGE,
                   help="container image with Tandem installed (default: %(default)s, what "
                        "`make image` builds)")
    p.add_argument("--model", default=None,
                   help="model directory inside the containers (default: the default model, "
                        "converted in the image)")
    p.add_argument("--model-pvc", default=None,
                   help="PersistentVolumeClaim holding the model, mounted at --model-mount")
    p.add_argument("--model-mount", default=defaults.model_mount, help="(default: %(default)s)")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="the names clients call the model by, given to every replica: the "
                        "first names it in answers and metrics, requests may use any "
                        "(default: the model directory's name)")
    add_model_settings_args(p)
    p.add_argument("--name", default=defaults.name, help="name prefix (default: %(default)s)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--prefill", type=int, default=defaults.prefill,
                   help="prefill replicas (default: %(default)s)")
    p.add_argument("--decode", type=int, default=defaults.decode,
                   help="decode replicas (default: %(default)s)")
    p.add_argument("--both", type=int, default=defaults.both,
                   help="aggregated replicas (default: %(default)s)")
    p.add_argument("--gpus", type=int, default=defaults.gpus,
                   help="GPUs per replica, 0 for CPU (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", type=positive_int,
                   default=defaults.tensor_parallel_size, metavar="N",
                   help="tensor-parallel ranks per replica: N GPUs, or N times "
                        "--replica-cpu/--replica-memory (default: %(default)s)")
    p.add_argument("--prefill-tensor-parallel-size", type=positive_int, default=None,
                   metavar="N", help="prefill replicas' ranks, when they differ "
                                     "(default: --tensor-parallel-size)")
    p.add_argument("--replica-cpu", default=defaults.replica_cpu,
                   help="CPUs each replica requests (default: %(default)s)")
    p.add_argument("--exclusive-cpus", action="store_true",
                   help="CPU limit = request (whole CPUs): Guaranteed pods, which a kubelet "
                        "with the static CPU manager gives cores of their own")
    p.add_argument("--replica-memory", default=defaults.replica_memory)
    p.add_argument("--kv-cache-memory", default=defaults.kv_cache_memory,
                   help="CPU KV cache per replica (default: %(default)s)")
    p.add_argument("--envoy-image", default=defaults.envoy_image)
    p.add_argument("--envoy-replicas", type=int, default=defaults.envoy_replicas)
    p.add_argument("--picker-replicas", type=int, default=defaults.picker_replicas,
                   help="endpoint pickers, active-active: each holds the whole prefix index "
                        "(default: %(default)s)")
    p.add_argument("--drain-seconds", type=int, default=defaults.drain_seconds,
                   help="seconds a stopping replica (--shutdown-grace) and Envoy give the "
                        "streams in flight (default: %(default)s)")
    p.add_argument("--tls-secret", default=None,
                   help="a kubernetes.io/tls Secret: Envoy also serves HTTPS on 8443")
    p.add_argument("--no-suite-tls", dest="suite_tls", action="store_false",
                   help="plaintext between the suite's pods (default: mutual TLS with the "
                        "certificate in the Secret NAME-suite-tls: tandem tls init DIR, then "
                        "kubectl create secret generic NAME-suite-tls --from-file=DIR)")
    p.add_argument("--api-key-secret", default=None,
                   help="a Secret whose 'api-keys' entry lists API keys (one per line): "
                        "Envoy requires one on every request")
    p.add_argument("--lora-syncer", action="store_true",
                   help="a sidecar in every replica pod loads and unloads LoRA adapters as "
                        "the ConfigMap NAME-lora-adapters lists them (the inference "
                        "extension's format; needs --allow-runtime-lora-updating)")
    p.add_argument("--gateway-name", default=defaults.gateway_name,
                   help="the Gateway the HTTPRoute attaches to (default: %(default)s)")
    p.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="KV tiers: a host-memory tier of SIZE per replica (e.g. 4GiB)")
    p.add_argument("--kv-store", default=None, metavar="URL|statefulset",
                   help="KV tiers: the Redis every replica shares (redis://... or "
                        "rediss://...), or 'statefulset' to render a one-pod Redis for "
                        "trying it out")
    p.add_argument("--kv-store-secret", default=None, metavar="SECRET",
                   help="KV tiers: a Secret whose 'password' key is the Redis password")
    p.add_argument("--kv-tier-weights", type=tier_weights_argument, default=None,
                   metavar="TIER=W,...", help="the endpoint picker's: " + TIER_WEIGHTS_HELP)
    p.add_argument("-o", "--output", type=Path, required=True, help="directory to write")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem render", formatter_class=DefaultsHelpFormatter,
                                     description="Render Envoy or Kubernetes configuration.")
    sub = parser.add_subparsers(dest="what", required=True)
    _add_envoy(sub)
    _add_k8s(sub)
    return parser


def _render_envoy(args: argparse.Namespace) -> int:
    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: give both --tls-cert and --tls-key", file=sys.stderr)
        return 2
    tls = TlsFiles(args.tls_cert, args.tls_key, args.https_port) if args.tls_cert else None
    try:
        descriptor: Path | bytes = (args.descriptor.read_bytes() if args.inline_descriptor
                                    else args.descriptor)
        if args.bootstrap:
            api_keys = read_api_keys(args.api_key_file) if args.api_key_file else []
            config = with_api_keys(yaml.safe_load(args.bootstrap.read_text()), api_keys)
        else:
            config = bootstrap_from_args(args, descriptor=descriptor, tls=tls, local=False)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = dump_bootstrap(config)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        if args.api_key_file is not None:
            args.output.touch(mode=0o600)  # it holds the keys (read_api_keys refuses none)
        args.output.write_text(text)
        print(f"wrote {args.output}")
    return 0


def manifest_file_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_manifests(objects: list[dict[str, Any]], directory: Path) -> list[Path]:
    """One YAML file per object; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for obj in objects:
        path = directory / manifest_file_name(obj)
        path.write_text(dump_yaml(obj))
        paths.append(path)
    return paths


def _render_k8s(args: argparse.Namespace) -> int:
    try:
        options = K8sOptions(
            image=args.image, model=args.model, name=args.name, namespace=args.namespace,
            prefill=args.prefill, decode=args.decode, both=args.both, model_pvc=args.model_pvc,
            model_mount=args.model_mount, served_model_names=tuple(args.served_model_name),
            model_settings=model_settings_from_args(args),
            replica_cpu=args.replica_cpu, exclusive_cpus=args.exclusive_cpus,
            replica_memory=args.replica_memory, gpus=args.gpus,
            tensor_parallel_size=args.tensor_parallel_size,
            prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
            kv_cache_memory=args.kv_cache_memory, envoy_image=args.envoy_image,
            envoy_replicas=args.envoy_replicas, picker_replicas=args.picker_replicas,
            drain_seconds=args.drain_seconds,
            tls_secret=args.tls_secret, api_key_secret=args.api_key_secret,
            suite_tls=args.suite_tls,
            gateway_name=args.gateway_name, lora_syncer=args.lora_syncer,
            kv_offload_memory=args.kv_offload_memory, kv_store=args.kv_store,
            kv_store_secret=args.kv_store_secret, kv_tier_weights=args.kv_tier_weights)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in write_manifests(render_k8s_manifests(options), args.output):
        print(f"wrote {path}")
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "envoy":
        return _render_envoy(args)
    return _render_k8s(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
