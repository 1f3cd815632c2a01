"""Pinning replicas to CPUs: the flag's parsing, the suite's split, and a real pinned replica.

A replica started with ``--cpus`` must run its frontend and its engine-core child on those
CPUs only, with one OpenMP/torch thread per CPU; ``--engine-cpus`` puts the engine core alone
on some of them and the frontend on the rest (by default, on a decoding replica that owns two
CPUs or more: all but the first); ``tandem up --cpu-layout`` shares a host's CPUs among a
suite's processes (by default for P/D: decode engine cores apart from everything else).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploy.cpu_layout import CpuPlan, plan_cpus, split_cpus
from deploy.suite_plan import SuiteConfig, plan_suite
from engine_common.model_runner import rank_cpus
from services.replica.cpu_binding import (
    cgroup_cpu_limit,
    default_engine_cpus,
    omp_num_threads_from_env,
    parse_cpus,
    parse_engine_cpus,
    split_engine_cpus,
)
from tests.replica_process import REPO_ROOT, start_replicas


def test_cpu_lists_parse_like_taskset():
    assert parse_cpus("3") == [3]
    assert parse_cpus("0-3") == [0, 1, 2, 3]
    assert parse_cpus("0,2,5-6") == [0, 2, 5, 6]
    for bad in ("", "a", "3-", "-1", "1,,2", "5-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="CPU list"):
            parse_cpus(bad)
    assert parse_engine_cpus("auto") == "auto"
    assert parse_engine_cpus("none") == "none"
    assert parse_engine_cpus("1-2") == [1, 2]
    with pytest.raises(argparse.ArgumentTypeError, match="or auto or none"):
        parse_engine_cpus("some")


def test_cpus_split_evenly_among_replicas():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="at least 3 CPUs"):
        split_cpus([0, 1], 3)


def test_the_suite_passes_each_replica_its_share():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        with pytest.raises(ValueError, match="at least 2 CPUs"):
            plan_suite(SuiteConfig(num_prefill=1, num_decode=1, cpu_layout="even"))
        return
    suite = plan_suite(SuiteConfig(num_prefill=1, num_decode=1, cpu_layout="even"))
    replica_args = [spec.argv for spec in suite.specs if spec.name != "gateway"]
    shares = [argv[argv.index("--cpus") + 1] for argv in replica_args]
    assert shares == [",".join(map(str, share)) for share in split_cpus(cpus, 2)]
    assert all(spec.cpus is None for spec in suite.specs)


def test_unpinned_decoding_replicas_share_every_cpu_rather_than_stack_their_engines():
    assert plan_cpus("shared", ["prefill", "decode"], [0, 1], True).replica_args == [[], []]
    assert plan_cpus("shared", ["decode", "both", "prefill"], [0, 1], True).replica_args == [
        ["--engine-cpus", "none"], ["--engine-cpus", "none"], []]


def test_by_role_gives_decode_engines_cpus_of_their_own():
    # The 2-core default: the decode engine alone on CPU 1; prefill, every frontend, the
    # gateway and Envoy on CPU 0.
    assert plan_cpus("auto", ["prefill", "decode"], [0, 1], True) == CpuPlan(
        [["--cpus", "0"], ["--cpus", "0,1", "--engine-cpus", "1"]], [0], "by-role")
    # Half the host to the decode engines, split among them; the rest among prefills.
    plan = plan_cpus("by-role", ["prefill", "prefill", "decode", "decode"], list(range(8)), True)
    assert plan.replica_args == [
        ["--cpus", "0,1"], ["--cpus", "2,3"],
        ["--cpus", "0,1,2,3,4,5", "--engine-cpus", "4,5"],
        ["--cpus", "0,1,2,3,6,7", "--engine-cpus", "6,7"]]
    assert plan.service_cpus == [0, 1, 2, 3]
    # Every prefill replica keeps a CPU, however many decode replicas there are.
    assert plan_cpus("by-role", ["prefill", "decode", "decode"], [0, 1, 2], True).replica_args == [
        ["--cpus", "0"], ["--cpus", "0,1", "--engine-cpus", "1"],
        ["--cpus", "0,2", "--engine-cpus", "2"]]
    # Without prefill replicas the frontends, gateway and Envoy keep one CPU, as `vllm serve`
    # keeps one for its API server.
    assert plan_cpus("auto", ["both"], [0, 1], True) == CpuPlan(
        [["--cpus", "0,1", "--engine-cpus", "1"]], [0], "by-role")


def test_tensor_parallel_ranks_get_a_cpu_each_where_the_host_has_them():
    """A TP replica's ranks each take a contiguous part of its engine's CPUs
    (``rank_cpus``); by-role splits the decoding engines' CPUs by rank count, and where a
    share is smaller than the ranks, the engine spreads over the replica's CPUs instead of
    time-slicing its ranks on one."""
    # 2 cores, 1 prefill and a TP=2 decode: auto does not squeeze 2 ranks beside the
    # prefill's CPU; by-role asked for gives the ranks both CPUs (rank 0 beside the
    # frontends on CPU 0, rank 1 alone on CPU 1).
    assert plan_cpus("auto", ["prefill", "decode"], [0, 1], True, [1, 2]).layout == "shared"
    assert plan_cpus("by-role", ["prefill", "decode"], [0, 1], True, [1, 2]) == CpuPlan(
        [["--cpus", "0"], ["--cpus", "0,1", "--engine-cpus", "none"]], [0], "by-role")
    assert [rank_cpus([0, 1], rank, 2) for rank in range(2)] == [[0], [1]]
    assert rank_cpus([1], 0, 2) is None  # fewer CPUs than ranks: unpinned, time-sliced
    # The replica's own default (shared layout, `tandem serve`): engine CPUs apart only
    # when each rank gets one.
    assert default_engine_cpus("decode", "cpu", [0, 1], None, None, ranks=2) is None
    assert default_engine_cpus("decode", "cpu", [0, 1, 2], None, None, ranks=2) == [1, 2]
    # 8 CPUs: the TP=2 decode engine gets two thirds of the decode engines' half.
    plan = plan_cpus("auto", ["prefill", "decode", "decode"], list(range(8)), True, [2, 2, 1])
    assert plan.replica_args[1:] == [["--cpus", "0,1,2,3,4,5,6", "--engine-cpus", "4,5,6"],
                                     ["--cpus", "0,1,2,3,7", "--engine-cpus", "7"]]


def test_auto_pins_nothing_it_cannot_own_or_split():
    # A CPU quota or OMP_NUM_THREADS below the visible CPUs; too few CPUs; only prefill.
    assert plan_cpus("auto", ["prefill", "decode"], [0, 1], owned=False).layout == "shared"
    assert plan_cpus("auto", ["prefill", "decode", "both"], [0, 1], True).layout == "shared"
    assert plan_cpus("auto", ["prefill", "decode"], [0], True).layout == "shared"
    assert plan_cpus("auto", ["both", "both"], [0, 1], True).layout == "shared"
    assert plan_cpus("auto", ["prefill"], [0, 1], True).layout == "shared"
    with pytest.raises(ValueError, match="needs a CPU for each decode or both"):
        plan_cpus("by-role", ["both", "both"], [0, 1], True)
    with pytest.raises(ValueError, match="unknown CPU layout"):
        plan_cpus("pinned", ["prefill", "decode"], [0, 1], True)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_the_suite_pins_the_gateway_and_envoy_by_role():
    suite = plan_suite(SuiteConfig(num_prefill=1, num_decode=1, envoy=True, cpu_layout="by-role"))
    front = sorted(os.sched_getaffinity(0))[:-(len(os.sched_getaffinity(0)) // 2)]
    assert suite.cpu_layout == "by-role"
    assert {spec.name: spec.cpus for spec in suite.specs}["gateway"] == front
    assert {spec.name: spec.cpus for spec in suite.specs}["envoy"] == front


def test_a_pinned_program_and_its_children_run_on_the_cpus_given():
    cpu = max(os.sched_getaffinity(0))
    child = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); " \
            "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    run = subprocess.run(
        [sys.executable, "-m", "deploy.pinned_exec", str(cpu), "--", sys.executable, "-c", child],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [f"[{cpu}]", f"[{cpu}]"]


def test_a_decoding_replica_that_owns_cpus_to_spare_keeps_one_for_its_frontend():
    assert default_engine_cpus("decode", "cpu", [4, 5, 6], None, None) == [5, 6]
    assert default_engine_cpus("both", "cpu", [0, 1], 2, 2.0) == [1]
    # One CPU: nothing to split. Prefill: every thread for its prompts. GPU: no OpenMP work.
    assert default_engine_cpus("decode", "cpu", [3], None, None) is None
    assert default_engine_cpus("prefill", "cpu", [0, 1, 2], None, None) is None
    assert default_engine_cpus("decode", "cuda", [0, 1], None, None) is None
    # A pod that sees the whole node but may use only part of it (quota, OMP_NUM_THREADS)
    # does not own those CPUs: pinning a thread to each would oversubscribe its share.
    assert default_engine_cpus("decode", "cpu", list(range(64)), 4, None) is None
    assert default_engine_cpus("decode", "cpu", list(range(64)), None, 4.0) is None
    assert default_engine_cpus("decode", "cpu", [0, 1, 2, 3], 4, 4.0) == [1, 2, 3]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_cpu_limit_is_read_along_the_process_cgroup_path(tmp_path: Path):
    v2, proc = tmp_path / "v2", tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/replica\n")
    _write(v2 / "kubepods/pod1/replica/cpu.max", "max 100000\n")
    _write(v2 / "kubepods/pod1/cpu.max", "250000 100000\n")
    _write(v2 / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(v2, proc) == 2.5
    _write(v2 / "kubepods/pod1/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(v2, proc) is None

    v1 = tmp_path / "v1"
    _write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(v1 / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    _write(v1 / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(v1, proc) is None
    _write(v1 / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    assert cgroup_cpu_limit(v1, proc) == 1.5
    assert cgroup_cpu_limit(v1, tmp_path / "missing") is None


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
        assert f"engine-core on CPUs [{cpu}] (1 torch threads)" in replica.log()
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


def test_a_replica_splits_its_cpus_by_default_only_when_it_owns_them(
        tiny_llama_dir: Path, tmp_path: Path):
    """The replica's default (``--engine-cpus auto``) against the rule, on this machine: on
    the 2-core CI box without a quota the engine core gets CPU 1 and the frontend CPU 0."""
    cpus = sorted(os.sched_getaffinity(0))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    expected = default_engine_cpus("both", device, cpus, omp_num_threads_from_env(),
                                   cgroup_cpu_limit())
    replica = start_replicas(tiny_llama_dir, tmp_path, {
        "auto": ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--role", "both"],
    })["auto"]
    try:
        core = replica.engine_core_pid()
        if expected is None:
            assert os.sched_getaffinity(core) == set(cpus)
        else:
            assert os.sched_getaffinity(core) == set(expected)
            assert os.sched_getaffinity(replica.process.pid) == set(cpus) - set(expected)
    finally:
        replica.kill()
