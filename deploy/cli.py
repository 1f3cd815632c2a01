"""The ``tandem`` command: serve a replica, run the gateway, start a local suite, generate.

Each subcommand is a thin front over the module that owns the work: ``services.replica``
(serve), ``gateway`` (gateway), ``deploy.supervisor`` (up), ``deploy.demo`` (demo), the SDK
(generate, chat, lora), ``deploy.lora_sync`` (lora sync) and ``engine_common.default_model``
(prepare-model).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deploy.cpu_layout import LAYOUTS
from deploy.envoy_config import read_api_keys
from deploy.local_ca import make_suite_certificates
from deploy.suite_plan import SuiteConfig, plan_suite
from deploy.supervisor import SuiteFailed, Supervisor, check_ports
from gateway.tier_weights import TIER_WEIGHTS_HELP, format_tier_weights, tier_weights_argument
from services.help_format import DefaultsHelpFormatter
from services.model_args import ModelDirError, check_model_dir
from services.model_settings import model_settings_from_args
from services.observability.settings import (
    ObservabilitySettings,
    add_observability_args,
    observability_args,
)
from services.replica.engine_flags import add_engine_args, engine_argv, positive_int
from services.suite_tls import SuiteTls
from tandem.channel_security import TlsConfig


def add_suite_args(parser: argparse.ArgumentParser) -> None:
    """``tandem up``'s flags: the suite's shape and ports, then every replica's engine flags
    (those of ``tandem serve``, one definition) and the processes' logging and traces."""
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill replicas")
    parser.add_argument("--decode", type=int, default=1, help="number of decode replicas")
    parser.add_argument("--both", type=int, default=0, help="number of aggregated replicas")
    parser.add_argument("--host", default="127.0.0.1", help="address every process binds")
    parser.add_argument("--base-port", type=int, default=50100,
                        help="first replica gRPC port (the others follow)")
    parser.add_argument("--gateway-port", type=int, default=50051, help="the gateway's gRPC port")
    parser.add_argument("--metrics-base-port", type=int, default=9100,
                        help="first /metrics port: the replicas', then the gateway's")
    parser.add_argument("--cpu-layout", choices=LAYOUTS, default="auto",
                        help="how the suite shares this host's CPUs: by-role (decode engine "
                             "cores get CPUs of their own, prefill replicas, frontends, the "
                             "gateway and Envoy the rest), even (a share per replica), shared "
                             "(no pinning); auto: by-role for a P/D suite on CPUs it owns, "
                             "else shared (default: %(default)s)")
    parser.add_argument("--no-gateway", action="store_true", help="start replicas only")
    parser.add_argument("--envoy", action="store_true", help="also start Envoy (HTTP, OpenAI routes)")
    parser.add_argument("--http-port", type=int, default=8080, help="Envoy's HTTP port")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="with --envoy: require one of the API keys in this file (one per "
                             "line) on every HTTP and gRPC request through Envoy")
    parser.add_argument("--log-dir", type=Path, default=Path(".cache/tandem/logs"),
                        help="each process's log file")
    parser.add_argument("--tls-dir", type=Path, default=None,
                        help="the suite's mutual-TLS files (tls.crt, tls.key, ca.crt; `tandem tls "
                             "init`); default: a throwaway CA and certificate made for this run "
                             "in a private temporary directory (printed; removed at the end)")
    parser.add_argument("--no-suite-tls", action="store_true",
                        help="plaintext between the suite's processes (replicas accept any "
                             "caller)")
    parser.add_argument("--kv-tier-weights", type=tier_weights_argument, default=None,
                        metavar="TIER=W,...", help="the gateway's: " + TIER_WEIGHTS_HELP)
    add_engine_args(parser)
    parser.add_argument("--prefill-tensor-parallel-size", type=positive_int, default=None,
                        metavar="N", help="the prefill replicas' tensor-parallel ranks, when "
                        "they differ from --tensor-parallel-size (the KV moves per rank)")
    parser.set_defaults(kv_cache_memory="512MiB")  # per replica: a suite runs several
    add_observability_args(parser)


def suite_config(args: argparse.Namespace) -> SuiteConfig:
    if args.api_key_file is not None:
        if not args.envoy:
            raise SystemExit("error: --api-key-file protects Envoy's edge; add --envoy")
        try:
            read_api_keys(args.api_key_file)  # fail now, not after the replicas started
        except (OSError, ValueError) as error:
            raise SystemExit(f"error: --api-key-file: {error}") from error
    return SuiteConfig(
        model=args.model, served_model_names=args.served_model_name,
        num_prefill=args.prefill, num_decode=args.decode, num_both=args.both,
        host=args.host, base_port=args.base_port, gateway_port=args.gateway_port,
        metrics_base_port=args.metrics_base_port, kv_cache_memory=str(args.kv_cache_memory),
        gateway=not args.no_gateway, envoy=args.envoy, envoy_http_port=args.http_port,
        envoy_api_key_file=args.api_key_file,
        cpu_layout=args.cpu_layout, model_settings=model_settings_from_args(args),
        tls_dir=None if args.no_suite_tls else args.tls_dir,
        engine_args=engine_argv(args, omit={"kv_cache_memory", "tensor_parallel_size"}),
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        process_args=observability_args(ObservabilitySettings.from_args("", args)),
        extra_gateway_args=[] if args.kv_tier_weights is None
        else ["--kv-tier-weights", format_tier_weights(args.kv_tier_weights)],
    )


def start_suite(args: argparse.Namespace) -> Supervisor:
    """Start the suite and wait until every process is ready; exits with a one-line error
    (no traceback) when a port is taken or a process keeps failing at start."""
    try:
        check_model_dir(args.model)  # before any process is spawned
    except ModelDirError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        check_ports(plan_suite(suite_config(args)).specs)  # before any model is touched
    except (SuiteFailed, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    if args.model is None:
        from engine_common.default_model import ensure_default_model

        print("preparing the default model (converted once, then cached) ...", flush=True)
        args.model = str(ensure_default_model())
    config = suite_config(args)
    tls = _load_tls(config.tls_dir)
    suite = plan_suite(config)
    supervisor = Supervisor(suite, args.log_dir, tls=tls)
    print(f"starting {len(suite.specs)} processes, CPU layout {suite.cpu_layout} (logs in "
          f"{args.log_dir}) ...", flush=True)
    started = time.monotonic()
    try:
        supervisor.start()
    except SuiteFailed as error:
        supervisor.stop()
        raise SystemExit(f"error: {error}") from None
    except KeyboardInterrupt:
        print("stopping the suite ...", flush=True)
        supervisor.stop()
        raise SystemExit(130) from None
    except BaseException:
        supervisor.stop()
        raise
    print(f"all healthy after {time.monotonic() - started:.1f} s:")
    for name, endpoint in suite.endpoints.items():
        print(f"  {name:42s} {endpoint}")
    return supervisor


@contextlib.contextmanager
def suite_certificates(args: argparse.Namespace) -> Iterator[None]:
    """Unless --tls-dir names them or --no-suite-tls turns them off: a throwaway CA and
    suite certificate for this run (into ``args.tls_dir``), removed when it ends."""
    if args.no_suite_tls or args.tls_dir is not None:
        yield
        return
    directory = Path(tempfile.mkdtemp(prefix="tandem-suite-tls-"))  # mode 0700
    try:
        args.tls_dir = make_suite_certificates(directory)
        print(f"suite mutual TLS: a throwaway CA and certificate in {directory} (replicas "
              "serve only callers holding them: --tls-dir there to call one directly)",
              flush=True)
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _load_tls(directory: Path | None) -> SuiteTls | None:
    if directory is None:
        return None
    try:
        return SuiteTls.load(directory)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --tls-dir {directory}: {error}") from None


def cmd_up(args: argparse.Namespace) -> int:
    from deploy.kv_store import local_kv_store

    with suite_certificates(args), local_kv_store(args):
        return _serve_suite(args)


def _serve_suite(args: argparse.Namespace) -> int:
    supervisor = start_suite(args)
    print("serving (a process that dies is restarted); Ctrl-C or SIGTERM drains and stops "
          "everything", flush=True)
    try:
        supervisor.serve_forever()
    except SuiteFailed as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    print("stopped", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from deploy.demo import run_demo

    with suite_certificates(args):
        supervisor = start_suite(args)
        try:
            target = (f"{args.host}:{args.gateway_port}" if not args.no_gateway
                      else f"{args.host}:{args.base_port}")
            client_tls = (TlsConfig.from_dir(args.tls_dir)
                          if args.no_gateway and supervisor.tls is not None else False)
            run_demo(target, [f"{args.host}:{args.base_port + i}"
                              for i in range(args.prefill + args.decode + args.both)],
                     supervisor.tls, client_tls)
        finally:
            print("stopping the suite ...", flush=True)
            supervisor.stop()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.errors import TandemError, UnavailableError

    printed = False
    try:
        for text in _generated_text(args):
            print(text, end="", flush=True)
            printed = True
    except UnavailableError as error:
        print("\n" if printed else "", end="", flush=True)
        print(f"error: cannot reach {args.target}: check that a suite (`tandem up`) or a "
              f"replica serves there and that --target is its gRPC host:port "
              f"({_first_line(error.details)})", file=sys.stderr)
        return 1
    except TandemError as error:
        print("\n" if printed else "", end="", flush=True)
        print(f"error: {_first_line(error.details)} ({error.code.name})", file=sys.stderr)
        return 1
    print()
    return 0


def _generated_text(args: argparse.Namespace) -> Iterator[str]:
    """The completion's (or with --chat, the reply's) text as it streams."""
    from tandem.client import Client

    tls = TlsConfig.from_dir(args.tls_dir) if args.tls_dir else False
    with Client(args.target, tls=tls) as client:
        if args.chat:
            for chunk in client.chat_stream([{"role": "user", "content": args.prompt}],
                                            model=args.model, max_tokens=args.max_tokens,
                                            temperature=args.temperature):
                yield chunk.content
        else:
            for piece in client.complete_stream(args.prompt, model=args.model,
                                                max_tokens=args.max_tokens,
                                                temperature=args.temperature):
                yield piece.text


def _first_line(text: str, limit: int = 300) -> str:
    """A server's message as one bounded line."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def cmd_lora(args: argparse.Namespace) -> int:
    from tandem.client import Client
    from tandem.errors import TandemError

    with Client(args.target) as client:
        try:
            served = (client.load_lora_adapter(args.name, args.path) if args.action == "load"
                      else client.unload_lora_adapter(args.name))
        except TandemError as error:
            print(f"error: {error.details} ({error.code.name})", file=sys.stderr)
            return 1
    print(f"LoRA adapters served: {', '.join(served) or 'none'}")
    return 0


def cmd_lora_sync(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from deploy.lora_sync import LoraSyncer, parse_wanted_adapters
    from tandem.client import Client
    from tandem.errors import TandemError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    tls = TlsConfig.from_dir(args.tls_dir) if args.tls_dir else False
    with Client(args.target, timeout=args.timeout, tls=tls) as client:
        syncer = LoraSyncer(client)
        if not args.once:
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            try:
                syncer.run(args.config, args.interval, stop)
            except KeyboardInterrupt:
                pass
            return 0
        try:
            outcome = syncer.sync(parse_wanted_adapters(args.config.read_text()))
        except (OSError, ValueError) as error:
            print(f"error: {args.config}: {error}", file=sys.stderr)
            return 2
        except TandemError as error:
            print(f"error: {error.details} ({error.code.name})", file=sys.stderr)
            return 1
    print(f"loaded: {', '.join(outcome.loaded) or 'none'}; "
          f"unloaded: {', '.join(outcome.unloaded) or 'none'}")
    for name, why in outcome.failed.items():
        print(f"error: {name}: {why}", file=sys.stderr)
    return 1 if outcome.failed else 0


def cmd_tls_init(args: argparse.Namespace) -> int:
    from deploy.local_ca import make_suite_certificates

    directory = make_suite_certificates(args.directory)
    print(f"wrote a throwaway suite CA and certificate to {directory} (ca.crt, tls.crt, tls.key); "
          f"for Kubernetes: kubectl create secret generic NAME-suite-tls --from-file={directory}")
    return 0


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from engine_common.default_model import ensure_default_model

    print(ensure_default_model())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Subcommands owned by other modules keep their own parsers.
    if argv and argv[0] == "serve":
        from services.entrypoint import set_engine_process_settings

        set_engine_process_settings()  # before the replica's imports load torch
        from services.replica.main import main as serve_main

        return serve_main(argv[1:]) or 0
    if argv and argv[0] == "gateway":
        from gateway.__main__ import main as gateway_main

        return gateway_main(argv[1:]) or 0
    if argv and argv[0] == "picker":
        from gateway.endpoint_picker_main import main as picker_main

        return picker_main(argv[1:]) or 0
    if argv and argv[0] == "render":
        from deploy.render import main as render_main

        return render_main(argv[1:]) or 0

    args = build_parser().parse_args(argv)
    return int(args.func(args))


class _Parser(argparse.ArgumentParser):
    """A parser whose --help gives each flag's default; its subparsers are of this class too
    (``add_subparsers`` makes parsers of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the subcommands this module runs itself."""
    parser = _Parser(prog="tandem", description="Tandem: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run one replica (see `tandem serve --help`)")
    sub.add_parser("gateway", help="run the gateway (see `tandem gateway --help`)")
    sub.add_parser("picker", help="run the Envoy ext_proc endpoint picker (see `tandem picker --help`)")
    sub.add_parser("render", help="render Envoy / Kubernetes configuration")
    up = sub.add_parser("up", help="start a local suite: replicas, gateway, optionally Envoy")
    add_suite_args(up)
    up.set_defaults(func=cmd_up)
    demo = sub.add_parser("demo", help="start the suite, send real requests, print metrics, stop")
    add_suite_args(demo)
    demo.set_defaults(func=cmd_demo)
    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt", help="the prompt (with --chat, the user's message)")
    gen.add_argument("--target", default="127.0.0.1:50051",
                     help="the gateway's or a replica's gRPC host:port")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    gen.add_argument("--model", default=None,
                     help="the served model or one of its LoRA adapters (default: the model)")
    gen.add_argument("--tls-dir", type=Path, default=None,
                     help="mutual TLS with a replica of a suite that has it: the suite's "
                          "tls.crt, tls.key and ca.crt")
    gen.set_defaults(func=cmd_generate)
    _add_lora_commands(sub)
    tls = sub.add_parser("tls", help="the suite's mutual-TLS certificates")
    tls_actions = tls.add_subparsers(dest="tls_action", required=True)
    tls_init = tls_actions.add_parser(
        "init", help="write a throwaway CA and a suite certificate (ca.crt, tls.crt, tls.key) "
                     "for --tls-dir")
    tls_init.add_argument("directory", type=Path)
    tls_init.set_defaults(func=cmd_tls_init)
    prep = sub.add_parser("prepare-model", help="convert the default model once; print its directory")
    prep.set_defaults(func=cmd_prepare_model)
    return parser


def _add_lora_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``tandem lora load|unload|sync``."""
    lora = sub.add_parser("lora", help="load, unload or sync LoRA adapters on a running suite "
                                       "(started with --allow-runtime-lora-updating)")
    lora_actions = lora.add_subparsers(dest="action", required=True)
    lora_load = lora_actions.add_parser("load", help="serve the PEFT adapter in PATH as NAME")
    lora_load.add_argument("name")
    lora_load.add_argument("path", help="the adapter's directory, on the replicas' machines")
    lora_unload = lora_actions.add_parser("unload", help="stop serving adapter NAME")
    lora_unload.add_argument("name")
    lora_sync = lora_actions.add_parser(
        "sync", help="keep the adapters in step with a file (the inference extension's "
                     "LoRA syncer ConfigMap format; see deploy/lora_sync.py)")
    lora_sync.add_argument("--config", type=Path, required=True,
                           help="the file naming the adapters to serve and not to serve")
    lora_sync.add_argument("--interval", type=float, default=5.0,
                           help="seconds between checks of the file and the server "
                                "(default: %(default)s)")
    lora_sync.add_argument("--timeout", type=float, default=120.0,
                           help="seconds one load or unload may take (default: %(default)s)")
    lora_sync.add_argument("--tls-dir", type=Path, default=None,
                           help="mutual TLS with a replica started with --tls-dir: the suite's "
                                "tls.crt, tls.key and ca.crt")
    lora_sync.add_argument("--once", action="store_true",
                           help="sync once and exit (1 if anything failed)")
    for action, run in ((lora_load, cmd_lora), (lora_unload, cmd_lora), (lora_sync, cmd_lora_sync)):
        action.add_argument("--target", default="127.0.0.1:50051",
                            help="the gateway's or a replica's gRPC host:port")
        action.set_defaults(func=run)


if __name__ == "__main__":
    sys.exit(main())
