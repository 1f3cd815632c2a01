"""A tensor-parallel worker process (ranks 1 to N-1): joins its replica's group, loads its
part of the model, then runs every step rank 0 sends it until rank 0 says stop or is gone.

Started by ``workers.TensorParallelWorkers`` as ``python -m engine_common.parallel.worker``;
reads length-prefixed pickles from stdin (``step_message``). It ignores SIGINT and SIGTERM,
as the engine core does: it stops when rank 0 does (the end of its stdin), and a collective
in progress fails when rank 0 dies.

Owns the worker's loop only; the model and its step are ``ModelRunner``'s.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from typing import BinaryIO


def read_message(stream: BinaryIO) -> object:
    """The next message; EOFError at the end of the stream."""
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    size = int.from_bytes(header, "little")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    # NOTE: imported after the signals: loading torch takes seconds.
    import torch

    from engine_common.model.arch_config import ModelArchConfig
    from engine_common.model_runner import ModelRunner
    from engine_common.parallel.group import join_group
    from engine_common.parallel.kv_ranks import worker_kv
    from engine_common.parallel.step_message import StepMessage, WorkerSetup
    from kv_transfer.rank_reader import RankPull

    setup = read_message(stdin)
    assert isinstance(setup, WorkerSetup)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-worker-{setup.rank} %(message)s", force=True)
    if setup.cpus:
        os.sched_setaffinity(0, setup.cpus)
        torch.set_num_threads(len(setup.cpus))
    config = setup.config
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", setup.rank)
    parallel = join_group(setup.rank, config.tensor_parallel_size, setup.store_port, device)
    logging.info("rank %d of %d on CPUs %s (%d torch threads)", setup.rank, parallel.size,
                 sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    arch = ModelArchConfig.from_model_dir(config.model)
    runner = ModelRunner(config, arch, setup.eos_token_ids, setup.max_model_len,
                         parallel=parallel)
    # P/D: a prefill worker's cache mapped for readers, a decode worker's reads.
    kv = worker_kv(config, runner.kv_cache, os.path.basename(os.path.normpath(config.model)),
                   setup.rank, parallel.size, arch.num_kv_heads, setup.store_port)
    try:
        while (message := read_message(stdin)) is not None:
            if isinstance(message, RankPull):
                assert kv is not None
                kv.pull(message)
                continue
            assert isinstance(message, StepMessage)
            runner.release(message.released)
            runner.execute(message.scheduler_output)
    except EOFError:
        logging.error("rank 0 is gone: stopping")


if __name__ == "__main__":
    main()
