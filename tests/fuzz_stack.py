"""What the fuzz suite checks a running stack (``tests.openai_http``) for, after hostile
requests: every process alive, every replica idle (nothing running or waiting, every KV block
it had free free again), no traceback or ERROR line in any process's log (a client's mistake
is logged in one line at most, and not as an error), and a normal request still served, over
gRPC and over HTTP.

``Baseline`` is the replicas' free blocks and the logs' lengths before the fuzzing;
``assert_whole`` waits (a background response may still be finishing) and then fails with
what is wrong.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc

from protos.tandem.v1 import engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.openai_http import Stack
from tests.replica_process import envoy_answers, is_serving

IDLE_TIMEOUT_S = 60.0


def load_of(target: str) -> engine_pb2.LoadReport:
    with grpc.insecure_channel(target) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(),
                                                           timeout=10)


@dataclass(frozen=True)
class Baseline:
    """Each replica's free KV blocks when it was idle before the fuzzing, and how long each
    process's log was."""

    free_blocks: dict[str, int]
    log_sizes: dict[Path, int]

    @classmethod
    def of(cls, stack: Stack) -> Baseline:
        wait_idle(stack, {})
        return cls({name: load_of(r.target).num_free_blocks
                    for name, r in stack.replicas.items()},
                   {log: log.stat().st_size for log in stack.logs.glob("*.log")})

    def new_log_lines(self, stack: Stack) -> list[str]:
        """What the processes logged since."""
        lines = []
        for log in sorted(stack.logs.glob("*.log")):
            with open(log, "rb") as text:
                text.seek(self.log_sizes.get(log, 0))
                lines += [f"{log.name}: {line}" for line in
                          text.read().decode(errors="replace").splitlines()]
        return lines


def _problems(stack: Stack, free_blocks: dict[str, int]) -> list[str]:
    problems = []
    for name, replica in stack.replicas.items():
        if replica.process.poll() is not None:
            problems.append(f"replica {name} exited with {replica.process.returncode}")
            continue
        load = load_of(replica.target)
        if load.num_requests_running or load.num_requests_waiting:
            problems.append(f"replica {name}: {load.num_requests_running} running, "
                            f"{load.num_requests_waiting} waiting")
        if name in free_blocks and load.num_free_blocks != free_blocks[name]:
            problems.append(f"replica {name}: {load.num_free_blocks} free blocks, "
                            f"{free_blocks[name]} before")
    return problems


def wait_idle(stack: Stack, free_blocks: dict[str, int]) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while problems := _problems(stack, free_blocks):
        if time.monotonic() > deadline:
            raise AssertionError("the stack is not idle: " + "; ".join(problems))
        time.sleep(0.25)


def assert_alive(stack: Stack) -> None:
    """Every process answers: the replicas run, the gateway is SERVING, Envoy answers."""
    for name, replica in stack.replicas.items():
        assert replica.process.poll() is None, f"replica {name} died:\n{replica.log()[-3000:]}"
    assert is_serving(stack.gateway), "the gateway stopped serving"
    assert envoy_answers(stack.http_port), "Envoy stopped answering"


def assert_whole(stack: Stack, baseline: Baseline) -> None:
    """Alive, idle as before, and serving a normal request over gRPC and HTTP."""
    assert_alive(stack)
    wait_idle(stack, baseline.free_blocks)
    alarming = [line[:300] for line in baseline.new_log_lines(stack)
                if "Traceback" in line or " ERROR " in line]
    assert not alarming, "the processes logged errors:\n" + "\n".join(alarming[:20])
    with grpc.insecure_channel(stack.gateway) as channel:
        chat = generation_pb2.ChatCompletionRequest(model="tiny", max_tokens=3, temperature=0)
        chat.messages.add(role="user").content.string_value = "hello"
        answer = generation_pb2_grpc.GenerationStub(channel).ChatComplete(chat, timeout=60)
    assert answer.choices[0].finish_reason in ("length", "stop")
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3}).encode()
    request = urllib.request.Request(f"{stack.base_url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        assert json.loads(response.read())["choices"][0]["text"] is not None
    wait_idle(stack, baseline.free_blocks)
