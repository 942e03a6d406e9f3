"""`python -m specserve.engine.worker RANK`: a tensor-parallel worker process, started by rank
0 (`tensor_parallel.TensorParallel`). Its arguments arrive as one JSON line on stdin; stdin then
stays open, and its closing (rank 0 exited, crashed or was killed) ends this process at once,
whatever it is waiting for."""

from __future__ import annotations

import os
import sys
import threading

from specserve.engine.tensor_parallel import WorkerArgs, run_worker


def _exit_when_rank0_is_gone() -> None:
    # the raw descriptor: a buffered reader's lock held by this thread would stall shutdown
    while os.read(0, 4096):
        pass
    os._exit(0)          # not sys.exit: gloo's or the kernel's waits would hold the process


def main() -> None:
    rank = int(sys.argv[1])
    args = WorkerArgs.from_json(sys.stdin.buffer.readline().decode())
    threading.Thread(target=_exit_when_rank0_is_gone, daemon=True,
                     name="specserve-rank0-watch").start()
    run_worker(args, rank)


if __name__ == "__main__":
    main()
