"""Pinning replicas to CPUs: the flag's parsing, the suite's split, and a real pinned replica.

A replica started with ``--cpus`` must run its frontend and its engine-core child on those
CPUs only, with one OpenMP/torch thread per CPU; ``--engine-cpus`` puts the engine core alone
on some of them and the frontend on the rest; ``tandem up --pin-cpus`` gives each replica its
own share.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.supervisor import SuiteConfig, plan_suite, replica_cpu_args, split_cpus
from services.replica.main import parse_cpus, split_engine_cpus
from tests.replica_process import REPO_ROOT, start_replicas


def test_cpu_lists_parse_like_taskset():
    assert parse_cpus("3") == [3]
    assert parse_cpus("0-3") == [0, 1, 2, 3]
    assert parse_cpus("0,2,5-6") == [0, 2, 5, 6]
    for bad in ("", "a", "3-", "-1", "1,,2", "5-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="CPU list"):
            parse_cpus(bad)


def test_cpus_split_evenly_among_replicas():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="at least 3 CPUs"):
        split_cpus([0, 1], 3)


def test_the_suite_passes_each_replica_its_share():
    cpus = sorted(os.sched_getaffinity(0))
    suite = plan_suite(SuiteConfig(num_prefill=1, num_decode=1, pin_cpus=len(cpus) >= 2))
    replica_args = [spec.argv for spec in suite.specs if spec.name != "gateway"]
    if len(cpus) < 2:
        assert all("--cpus" not in argv for argv in replica_args)
        return
    shares = [argv[argv.index("--cpus") + 1] for argv in replica_args]
    assert shares == [",".join(map(str, share)) for share in split_cpus(cpus, 2)]


def test_a_decoding_replica_with_cpus_to_spare_keeps_one_for_its_frontend():
    assert replica_cpu_args("decode", [4, 5, 6]) == ["--cpus", "4,5,6", "--engine-cpus", "5,6"]
    assert replica_cpu_args("both", [0, 1]) == ["--cpus", "0,1", "--engine-cpus", "1"]
    assert replica_cpu_args("decode", [3]) == ["--cpus", "3"]
    assert replica_cpu_args("prefill", [0, 1, 2]) == ["--cpus", "0,1,2"]


def test_cpus_outside_the_allowed_set_are_refused():
    outside = max(os.sched_getaffinity(0)) + 1000
    run = subprocess.run(
        [sys.executable, "-m", "services.replica", "--cpus", str(outside)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "not within the CPUs this process may use" in run.stderr


def test_a_pinned_replica_and_its_engine_core_run_on_their_cpus(
        tiny_llama_dir: Path, tmp_path: Path):
    cpu = max(os.sched_getaffinity(0))
    replica = start_replicas(tiny_llama_dir, tmp_path, {
        "pinned": ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--cpus", str(cpu)],
    })["pinned"]
    try:
        core = replica.engine_core_pid()
        for pid in (replica.process.pid, core):
            assert os.sched_getaffinity(pid) == {cpu}
        environ = Path(f"/proc/{core}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ
    finally:
        replica.kill()


def test_engine_cpus_leave_the_frontend_the_other_cpus():
    assert split_engine_cpus([0, 1, 2, 3], [1, 2]) == [0, 3]
    with pytest.raises(ValueError, match="not within"):
        split_engine_cpus([0, 1], [2])
    with pytest.raises(ValueError, match="leaves no CPU"):
        split_engine_cpus([0, 1], [0, 1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_an_engine_core_on_its_own_cpus_with_the_frontend_beside_it(
        tiny_llama_dir: Path, tmp_path: Path):
    cpus = sorted(os.sched_getaffinity(0))
    engine_cpu = cpus[-1]
    replica = start_replicas(tiny_llama_dir, tmp_path, {
        "split": ["--dtype", "float32", "--kv-cache-memory", "16MiB",
                  "--engine-cpus", str(engine_cpu)],
    })["split"]
    try:
        core = replica.engine_core_pid()
        assert os.sched_getaffinity(core) == {engine_cpu}
        assert os.sched_getaffinity(replica.process.pid) == set(cpus) - {engine_cpu}
    finally:
        replica.kill()
