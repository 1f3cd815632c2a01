"""Rank 0's handle on its tensor-parallel workers (ranks 1 to N-1): starting them, sending
each step, noticing one die, stopping them.

Workers are separate interpreters (``python -m engine_common.parallel.worker``), not
multiprocessing children: rank 0 is usually the replica's engine-core process, a daemonic
child that multiprocessing forbids to have children of its own. Each worker reads pickled
messages from its stdin: a ``WorkerSetup``, then one ``StepMessage`` per step, then None.
Rank 0 pickles a step once and writes the same bytes to every worker, before its own
forward: the tensors travel through the collectives, only the schedule through the pipes.

A worker that exits (killed, out of memory, a failed collective) ends the replica's model:
a thread waits on each worker and calls ``on_death`` with the reason at once, idle or not
(the engine-core process exits non-zero there, and the replica reports NOT_SERVING as for
any dead core; its supervisor restarts it). A collective in progress fails by itself (gloo
sees the peer's sockets close); ``send`` refuses any later step. When rank 0 dies, its
workers read the end of their stdin and exit.

Owns the worker processes and the pipes to them; not what a worker does (``worker``).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable

from engine_common.parallel.step_message import StepMessage, WorkerSetup

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker of this replica is gone: no step can run."""


class TensorParallelWorkers:
    def __init__(self, setups: list[WorkerSetup],
                 on_death: Callable[[str], object] | None = None):
        """Starts one worker per setup (ranks 1 to N-1) and returns at once."""
        self._on_death = on_death
        self._closing = False
        self.dead_reason: str | None = None
        self._lock = threading.Lock()
        self._died = threading.Event()
        # Steps come from the core's thread, KV pulls' parts from the UCX loop's: one
        # writer at a time, so that no message interleaves with another in a pipe.
        self._send_lock = threading.Lock()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.processes: list[subprocess.Popen[bytes]] = []
        for setup in setups:
            process = subprocess.Popen([sys.executable, "-m", "engine_common.parallel.worker"],
                                       stdin=subprocess.PIPE, env=env)
            self.processes.append(process)
            self._write(process, pickle.dumps(setup))
            threading.Thread(target=self._watch, args=(setup.rank, process), daemon=True,
                             name=f"tp-worker-{setup.rank}-watch").start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def send(self, message: StepMessage) -> None:
        """Hand one step to every worker; WorkerDiedError if one is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for process in self.processes:
                if self.dead_reason is not None:
                    raise WorkerDiedError(self.dead_reason)
                self._write(process, data)

    def send_to(self, rank: int, message: object) -> None:
        """Hand one message (a KV pull's part, ``engine_common.parallel.kv_ranks``) to the
        worker of rank ``rank``; WorkerDiedError if it is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self.dead_reason is not None:
                raise WorkerDiedError(self.dead_reason)
            self._write(self.processes[rank - 1], data)

    def _write(self, process: subprocess.Popen[bytes], data: bytes) -> None:
        assert process.stdin is not None
        try:
            process.stdin.write(len(data).to_bytes(8, "little"))
            process.stdin.write(data)
            process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDiedError(self.dead_reason or
                                  f"tensor-parallel worker pid {process.pid} is gone") from exc

    def _watch(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        with self._lock:
            if self._closing or self.dead_reason is not None:
                return
            self.dead_reason = (f"tensor-parallel worker rank {rank} (pid {process.pid}) "
                                f"exited with code {code}: the replica's model cannot run")
            self._died.set()
        logger.error("%s", self.dead_reason)
        if self._on_death is not None:
            self._on_death(self.dead_reason)

    def wait_death(self, timeout: float) -> str | None:
        """Why a worker died, waiting up to ``timeout`` for its exit to be seen (a step that
        failed in a collective may fail before the watcher sees the process end); None if
        every worker still runs."""
        self._died.wait(timeout)
        return self.dead_reason

    def close(self, timeout: float = 10.0) -> None:
        """Ask every worker to stop, then wait; a worker still running after ``timeout`` is
        killed."""
        with self._lock:
            self._closing = True
        for process in self.processes:
            try:
                self._write(process, pickle.dumps(None))
                assert process.stdin is not None
                process.stdin.close()
            except WorkerDiedError:
                pass
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
