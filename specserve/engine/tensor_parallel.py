"""The processes of tensor parallelism: rank 0 is the engine's own process; ranks 1..N-1 are
worker processes (torch.multiprocessing, spawn) that load their shard of the target
(`models/tensor_parallel.py`) and run every target step the engine runs. All ranks join one
gloo process group over a TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's variables; by default
127.0.0.1 and a free port). Each step the engine sends the step's plain description (token
ids, positions, slots: JSON) to the workers, then every rank runs its shard; the all-reduces
inside the layers keep them in lockstep. The scheduler, sampler, verifier and proposers stay on
rank 0. With the CPU kernel, the steps and the layers' all-reduces go through memory the ranks
share (rank 0 makes it and hands it to the workers it spawns), not gloo's TCP round trips: on a
busy 2-core machine those cost hundreds of microseconds each, two per layer.

A worker that dies is noticed at the next step (or inside a collective, which then fails): the
engine raises and stops, and the server answers 503. Workers stop when the engine is closed,
garbage-collected or its process exits (they are daemons), and on Ctrl-C with it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.config import resolve_dtype
from specserve.kernels.cpu import (
    SharedMemoryAllReduce,
    SharedMemoryChannel,
    load_library,
    shm_numel,
)
from specserve.models.backend import Backend, make_kv_cache
from specserve.models.loader import load_model
from specserve.models.metadata import step_inputs
from specserve.models.tensor_parallel import gloo_all_reduce, shard

# Loading a large checkpoint on every rank can take minutes; a step never should.
STARTUP_TIMEOUT_S = 600
# Floats per rank in one call of the shared-memory all-reduce (512 rows of 2048); longer
# tensors go in parts.
SHM_CAP = 1 << 20
STEP_BYTES = 1 << 22            # room for a step's description (a few bytes per row)


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
    # SharedMemoryAllReduce's and SharedMemoryChannel's memory; None: gloo's collectives
    shm: tuple[torch.Tensor, torch.Tensor] | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(a: WorkerArgs, rank: int) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    return dist.TCPStore(a.addr, a.port, a.size, rank == 0, timeout=timeout,
                         wait_for_workers=False)


@dataclass
class _Link:
    """A rank's connections: the gloo group, and the shared-memory channel of the steps where
    the ranks use the CPU kernel."""
    group: dist.ProcessGroup
    channel: SharedMemoryChannel | None


def _shard(a: WorkerArgs, rank: int, model: torch.nn.Module, store: dist.TCPStore,
           check_peers: Callable[[], None]) -> tuple[torch.nn.Module, _Link]:
    """Join the gloo group (an object of its own: no process-global default group) and keep
    this rank's shard of `model`, ready for inference on the CPU. `check_peers` raises when a
    rank that shared memory waits for is gone."""
    group = dist.ProcessGroupGloo(store, rank, a.size,
                                  datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    backend = Backend(torch.device("cpu"), resolve_dtype(a.dtype), a.cpu_kernel,
                      quantization=a.quantization)
    if a.shm is None:
        reduce, channel = gloo_all_reduce(group), None
    else:
        lib = load_library()
        reduce = SharedMemoryAllReduce(lib, a.shm[0], rank, a.size, SHM_CAP, check_peers)
        channel = SharedMemoryChannel(lib, a.shm[1], check_peers)
    return backend.prepare(shard(model, rank, a.size, reduce)), _Link(group, channel)


def _load(a: WorkerArgs) -> torch.nn.Module:
    return load_model(a.model, resolve_dtype(a.dtype), torch.device("cpu"), max_len=a.max_len)


def _rank0_alive(parent: int) -> None:
    if os.getppid() != parent:
        raise WorkerDied("rank 0 is gone; this worker stops")


def _worker(a: WorkerArgs, rank: int) -> None:
    torch.set_num_threads(a.threads)
    parent = os.getppid()
    store = _store(a, rank)
    model = _load(a)
    store.set(f"loaded{rank}", "1")
    model, link = _shard(a, rank, model, store, lambda: _rank0_alive(parent))
    cache = make_kv_cache(model, a.num_slots, a.max_len)
    link.group.allreduce([torch.zeros(1)]).wait()                # ready
    with torch.inference_mode():
        while data := _receive(link):
            ids, positions, md = step_inputs(json.loads(data), torch.device("cpu"))
            model(ids, positions, md, cache.layers)


def _receive(link: _Link) -> bytes:
    """The next step's description from rank 0 (empty: stop)."""
    if link.channel is not None:
        return link.channel.receive()
    n = torch.zeros(1, dtype=torch.long)
    link.group.broadcast(n, 0).wait()
    data = torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        link.group.broadcast(data, 0).wait()
    return data.numpy().tobytes()


def _stop(links: list[_Link], workers: list) -> None:
    """Tell live workers to stop (an empty step, once they are linked), then reap them."""
    if links and all(w.is_alive() for w in workers):
        try:
            if links[0].channel is not None:
                links[0].channel.send(b"")
            else:
                links[0].group.broadcast(torch.zeros(1, dtype=torch.long), 0).wait()
        except RuntimeError:
            pass
    for w in workers:
        w.join(timeout=10)
        if w.is_alive():
            w.kill()
            w.join()


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot go on."""


def _check_alive(workers: list, doing: str) -> None:
    dead = [w for w in workers if not w.is_alive()]
    if dead:
        raise WorkerDied(
            f"tensor-parallel worker {dead[0].name} died during {doing} (exit code "
            f"{dead[0].exitcode}); the engine stops: see the worker's error above (a "
            "script must build the engine under `if __name__ == \"__main__\":`, which "
            "multiprocessing's spawn needs) and restart it")


class TensorParallel:
    """Rank 0's side: starts the workers, holds the group, sends each step."""

    def __init__(self, model: str, size: int, dtype: str, max_len: int, num_slots: int,
                 cpu_kernel: bool, quantization: str | None = None) -> None:
        if size < 2:
            raise ValueError("tensor parallelism needs tensor_parallel_size >= 2")
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        # each rank its share of the cores (the engine's own threads included)
        threads = max(1, torch.get_num_threads() // size)
        # every rank is a process spawned here, so all share this machine's memory
        shm = ((torch.zeros(shm_numel(size, SHM_CAP), dtype=torch.int64).share_memory_(),
                torch.zeros(SharedMemoryChannel.HEADER + STEP_BYTES,
                            dtype=torch.uint8).share_memory_())
               if cpu_kernel and load_library() is not None else None)
        self.args = WorkerArgs(model, dtype, max_len, num_slots, cpu_kernel, quantization, size,
                               os.environ.get("MASTER_ADDR", "127.0.0.1"), port, threads, shm)
        self.store = _store(self.args, 0)              # the server: before any worker
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=_worker, args=(self.args, rank), daemon=True,
                                    name=f"specserve-tp-rank{rank}")
                        for rank in range(1, size)]
        for w in self.workers:
            w.start()
        self._links: list[_Link] = []                  # rank 0's link, once joined
        self._stopper = weakref.finalize(self, _stop, self._links, self.workers)

    def load(self) -> torch.nn.Module:
        """Rank 0's shard; returns once every worker has loaded and sharded its own."""
        model = _load(self.args)
        keys = [f"loaded{w}" for w in range(1, self.args.size)]
        self._poll(lambda: self.store.check(keys), "loading the model")
        # not a method: the link outlives this object (the finalizer that stops the workers
        # holds it) and must not keep it alive
        model, link = _shard(self.args, 0, model, self.store,
                             functools.partial(_check_alive, self.workers, "a step"))
        self._links.append(link)
        self._collective(lambda: link.group.allreduce([torch.zeros(1)]), "sharding the model")
        return model

    def step(self, step: dict) -> None:
        """Send a step (see `step_inputs`) to the workers; rank 0 then runs its own shard."""
        link, data = self._links[0], json.dumps(step).encode()
        if link.channel is not None:
            self._check_workers("a step")
            link.channel.send(data)
        else:
            self._collective(lambda: link.group.broadcast(torch.tensor([len(data)]), 0),
                             "a step")
            self._collective(lambda: link.group.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), 0), "a step")

    @contextlib.contextmanager
    def own_cores(self):
        """Rank 0's share of the threads for the block (an engine step: its shard, sampling,
        drafting). Were rank 0 to use more between its shard's steps, its idle OpenMP threads
        would spin on the cores the workers' shards run on."""
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
        _check_alive(self.workers, doing)

    def close(self) -> None:
        self._stopper()
