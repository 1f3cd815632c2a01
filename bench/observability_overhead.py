"""What observability costs a token stream: the interceptors on both ends of a gRPC hop.

One process, one event loop: a grpc.aio server streams ``Engine.Generate`` responses (one
token each, as a decode replica streams to the gateway) to a grpc.aio client. Two setups run
the same calls in interleaved rounds, their order shuffled per round:

  bare      grpc.aio.server() and grpc.aio.insecure_channel(): no interceptors
  observed  services.frontend.grpc_server.new_server([RequestLogInterceptor()]) (trace
            server interceptor, request log, request guard) and services.suite_tls
            .aio_channel() (trace and peer client interceptors), as the suite runs them

first with tracing off (no ``--otlp-traces-endpoint``: the default), then with an SDK tracer
provider installed (spans made and batched; the exporter drops them). Measured: the CPU
seconds this process (server, client and gRPC's threads) spends per streamed message, which
other tenants of a shared machine disturb far less than wall time; reported per setup, and
observed over bare, per round and of the medians.

    python bench/observability_overhead.py [--rounds 15] [--calls 5] [--tokens 300]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from protos.tandem.v1 import engine_pb2 as epb  # noqa: E402
from services.frontend.grpc_server import new_server  # noqa: E402
from services.observability.request_log import RequestLogInterceptor  # noqa: E402
from services.suite_tls import aio_channel  # noqa: E402

METHOD = "/tandem.v1.Engine/Generate"


def _handler(tokens: int) -> grpc.GenericRpcHandler:
    async def generate(request: epb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        for i in range(tokens):
            response = epb.GenerateResponse(
                request_id=request.request_id, new_token_ids=[1000 + i], delta_text=" tok",
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1)
            if i == tokens - 1:
                response.finish_reason = "length"
            await context.write(response)

    return grpc.method_handlers_generic_handler("tandem.v1.Engine", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=epb.GenerateRequest.FromString,
            response_serializer=epb.GenerateResponse.SerializeToString)})


async def _serve(observed: bool, tokens: int) -> tuple[grpc.aio.Server, str]:
    server = new_server([RequestLogInterceptor()]) if observed else grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(tokens),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _time_calls(channel: grpc.aio.Channel, calls: int) -> float:
    stub: Any = channel.unary_stream(
        METHOD, request_serializer=epb.GenerateRequest.SerializeToString,
        response_deserializer=epb.GenerateResponse.FromString)
    started = time.process_time()
    for call_index in range(calls):
        request = epb.GenerateRequest(request_id=f"r{call_index}", prompt_token_ids=[1] * 64)
        async for _ in stub(request):
            pass
    return time.process_time() - started


async def _phase(rounds: int, calls: int, tokens: int) -> dict[str, list[float]]:
    setups = {}
    for name, observed in (("bare", False), ("observed", True)):
        server, target = await _serve(observed, tokens)
        channel = (aio_channel(target, None) if observed
                   else grpc.aio.insecure_channel(target))
        setups[name] = (server, channel)
    per_message: dict[str, list[float]] = {name: [] for name in setups}
    for _server, channel in setups.values():  # warm up
        await _time_calls(channel, 2)
    for _ in range(rounds):
        order = list(setups)
        random.shuffle(order)
        for name in order:
            seconds = await _time_calls(setups[name][1], calls)
            per_message[name].append(seconds / (calls * tokens))
    for server, channel in setups.values():
        await channel.close()
        await server.stop(0)
    return per_message


def _summary(per_message: dict[str, list[float]]) -> dict[str, object]:
    bare, observed = per_message["bare"], per_message["observed"]
    return {
        "seconds_per_message": per_message,
        "observed_over_bare": statistics.median(observed) / statistics.median(bare),
        "observed_over_bare_per_round": [o / b for o, b in zip(observed, bare, strict=True)],
    }


def _install_tracing() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "observability_overhead.json")
    args = parser.parse_args(argv)
    logging.getLogger("tandem.requests").setLevel(logging.WARNING)  # timing, not printing
    off = asyncio.run(_phase(args.rounds, args.calls, args.tokens))
    _install_tracing()
    on = asyncio.run(_phase(args.rounds, args.calls, args.tokens))
    results = {"tracing_off": _summary(off), "tracing_on": _summary(on)}
    for name, result in results.items():
        print(f"{name}: observed/bare = {result['observed_over_bare']:.3f} "
              f"per round {[round(r, 3) for r in result['observed_over_bare_per_round']]}")
    write_report(args.out, "observability_overhead", settings=vars(args) | {
        "out": str(args.out)}, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
