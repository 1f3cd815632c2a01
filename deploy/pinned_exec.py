"""``python -m deploy.pinned_exec CPUS -- PROGRAM ARGS...``: run PROGRAM on CPUS only.

The supervisor starts a process it pins (the gateway and Envoy under ``--cpu-layout
by-role``) through this: the affinity is set before PROGRAM's first instruction, so every
thread and child it makes inherits it. Setting it from the parent after the start would
race the child's first threads; ``preexec_fn`` is unsafe in a parent with threads.
"""

from __future__ import annotations

import os
import sys

from services.replica.cpu_binding import parse_cpus


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m deploy.pinned_exec CPUS -- PROGRAM [ARGS...]")
    os.sched_setaffinity(0, parse_cpus(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
