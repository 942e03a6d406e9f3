"""The processes of tensor parallelism: rank 0 is the engine's own process; ranks 1..N-1 are
worker processes (torch.multiprocessing, spawn) that load their shard of the target
(`models/tensor_parallel.py`) and run every target step the engine runs. All ranks join one
gloo process group over a TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's variables; by default
127.0.0.1 and a free port). Each step the engine broadcasts the step's plain description
(token ids, positions, slots: JSON), then every rank runs its shard; the all-reduces inside the
layers keep them in lockstep. The scheduler, sampler, verifier and proposers stay on rank 0.

A worker that dies is noticed at the next step (or inside a collective, which then fails): the
engine raises and stops, and the server answers 503. Workers stop when the engine is closed,
garbage-collected or its process exits (they are daemons), and on Ctrl-C with it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.config import resolve_dtype
from specserve.models.backend import Backend, make_kv_cache
from specserve.models.loader import load_model
from specserve.models.metadata import step_inputs
from specserve.models.tensor_parallel import shard

# Loading a large checkpoint on every rank can take minutes; a step never should.
STARTUP_TIMEOUT_S = 600


@dataclass(frozen=True)
class WorkerArgs:
    model: str
    dtype: str
    max_len: int
    num_slots: int
    cpu_kernel: bool
    quantization: str | None
    size: int
    addr: str
    port: int
    threads: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(a: WorkerArgs, rank: int) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    return dist.TCPStore(a.addr, a.port, a.size, rank == 0, timeout=timeout,
                         wait_for_workers=False)


def _shard(a: WorkerArgs, rank: int, model: torch.nn.Module, store: dist.TCPStore
           ) -> tuple[torch.nn.Module, dist.ProcessGroup]:
    """Join the gloo group (an object of its own: no process-global default group) and keep
    this rank's shard of `model`, ready for inference on the CPU."""
    group = dist.ProcessGroupGloo(store, rank, a.size,
                                  datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    backend = Backend(torch.device("cpu"), resolve_dtype(a.dtype), a.cpu_kernel,
                      quantization=a.quantization)
    return backend.prepare(shard(model, rank, a.size, group)), group


def _load(a: WorkerArgs) -> torch.nn.Module:
    return load_model(a.model, resolve_dtype(a.dtype), torch.device("cpu"), max_len=a.max_len)


def _worker(a: WorkerArgs, rank: int) -> None:
    torch.set_num_threads(a.threads)
    store = _store(a, rank)
    model = _load(a)
    store.set(f"loaded{rank}", "1")
    model, group = _shard(a, rank, model, store)
    cache = make_kv_cache(model, a.num_slots, a.max_len)
    group.allreduce([torch.zeros(1)]).wait()                     # ready
    with torch.inference_mode():
        while (step := _receive(group)) is not None:
            ids, positions, md = step_inputs(step, torch.device("cpu"))
            model(ids, positions, md, cache.layers)


def _receive(group) -> dict | None:
    n = torch.zeros(1, dtype=torch.long)
    group.broadcast(n, 0).wait()
    if not int(n):
        return None
    data = torch.empty(int(n), dtype=torch.uint8)
    group.broadcast(data, 0).wait()
    return json.loads(data.numpy().tobytes())


def _stop(groups: list, workers: list) -> None:
    """Tell live workers to stop (a zero-length step on the group, once there is one), then
    reap them."""
    if groups and all(w.is_alive() for w in workers):
        try:
            groups[0].broadcast(torch.zeros(1, dtype=torch.long), 0).wait()
        except RuntimeError:
            pass
    for w in workers:
        w.join(timeout=10)
        if w.is_alive():
            w.kill()
            w.join()


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot go on."""


class TensorParallel:
    """Rank 0's side: starts the workers, holds the group, sends each step."""

    def __init__(self, model: str, size: int, dtype: str, max_len: int, num_slots: int,
                 cpu_kernel: bool, quantization: str | None = None) -> None:
        if size < 2:
            raise ValueError("tensor parallelism needs tensor_parallel_size >= 2")
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        # each rank its share of the cores (the engine's own threads included)
        threads = max(1, torch.get_num_threads() // size)
        self.args = WorkerArgs(model, dtype, max_len, num_slots, cpu_kernel, quantization, size,
                               os.environ.get("MASTER_ADDR", "127.0.0.1"), port, threads)
        self.store = _store(self.args, 0)              # the server: before any worker
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=_worker, args=(self.args, rank), daemon=True,
                                    name=f"specserve-tp-rank{rank}")
                        for rank in range(1, size)]
        for w in self.workers:
            w.start()
        self._groups: list = []                        # the group, once joined
        self._stopper = weakref.finalize(self, _stop, self._groups, self.workers)

    def load(self) -> torch.nn.Module:
        """Rank 0's shard; returns once every worker has loaded and sharded its own."""
        model = _load(self.args)
        keys = [f"loaded{w}" for w in range(1, self.args.size)]
        self._poll(lambda: self.store.check(keys), "loading the model")
        model, group = _shard(self.args, 0, model, self.store)
        self._groups.append(group)
        self._collective(lambda: group.allreduce([torch.zeros(1)]), "sharding the model")
        return model

    @contextlib.contextmanager
    def step(self, step: dict):
        """Send a step (see `step_inputs`) to the workers; rank 0 runs its own shard inside
        the block, with its share of the threads (the process's other work keeps them all)."""
        group, data = self._groups[0], json.dumps(step).encode()
        self._collective(lambda: group.broadcast(torch.tensor([len(data)]), 0), "a step")
        self._collective(lambda: group.broadcast(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), 0), "a step")
        threads = torch.get_num_threads()
        torch.set_num_threads(self.args.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _collective(self, post, doing: str) -> None:
        """Run the collective `post()` starts, failing (not hanging) when a worker has died:
        with WorkerDied naming it, also where gloo saw its connection close first."""
        try:
            work = post()
            self._poll(work.is_completed, doing)
            work.wait()
        except WorkerDied:
            raise
        except RuntimeError:
            deadline = time.monotonic() + 1       # a killed process is reaped within moments
            while time.monotonic() < deadline:
                self._check_workers(doing)
                time.sleep(0.01)
            raise

    def _poll(self, done, doing: str) -> None:
        while not done():
            self._check_workers(doing)
            time.sleep(0.0001)

    def _check_workers(self, doing: str) -> None:
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            raise WorkerDied(
                f"tensor-parallel worker {dead[0].name} died during {doing} (exit code "
                f"{dead[0].exitcode}); the engine stops: see the worker's error above (a "
                "script must build the engine under `if __name__ == \"__main__\":`, which "
                "multiprocessing's spawn needs) and restart it")

    def close(self) -> None:
        self._stopper()
