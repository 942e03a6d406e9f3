"""The processes of tensor parallelism: rank 0 is the engine's own process; ranks 1..N-1 are
worker processes (`python -m specserve.engine.worker`, started with subprocess: nothing of the
caller's script runs in them, so a script without a main guard, a REPL, a notebook or
`python -c` work alike) that load their shard of the target (`models/tensor_parallel.py`) and
run every target step the engine runs. All ranks join one gloo process group over a TCPStore at
MASTER_ADDR:MASTER_PORT (torchrun's variables; by default 127.0.0.1 and a free port). Each step
the engine sends the step's plain description (token ids, positions, slots: JSON) to the
workers, then every rank runs its shard; the all-reduces inside the layers keep them in
lockstep. The scheduler, sampler, verifier and proposers stay on rank 0. A drafter of
draft_tensor_parallel_size > 1 is sharded too: a draft model like the target (`add`), a head's
decoder layers alone (`shard_head`: the rest of the head stays on rank 0, which sends each
layer step its inputs). With the CPU kernel, the steps and the layers' all-reduces go through
memory the ranks share (files in /dev/shm that rank 0 makes and removes once every worker has
mapped them), not gloo's round trips over TCP, two per layer.

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set: one process per rank, on one
machine or several) no process is spawned: every rank runs the same script, rank 0 goes on as
the engine's and the others serve it inside `LLM(...)`, over gloo, then end their process.

A worker that dies is noticed at the next step (or inside a collective, which then fails): the
engine raises and stops, and the server answers 503. Workers stop when the engine is closed or
garbage-collected, and whenever rank 0's process ends, however it ends (SIGKILL included): each
worker reads a pipe from rank 0 that closes with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from specserve.config import resolve_dtype
from specserve.kernels.cpu import (
    SharedMemoryAllReduce,
    SharedMemoryChannel,
    load_library,
    shm_numel,
)
from specserve.kv_cache import KVCache
from specserve.models.backend import Backend, make_kv_cache
from specserve.models.layers import AttentionMetadata, model_tensor
from specserve.models.llama import DecoderLayer, LlamaArgs
from specserve.models.loader import load_model
from specserve.models.metadata import metadata_dict, metadata_from_dict, step_inputs
from specserve.models.tensor_parallel import (
    check_divisible,
    gloo_all_reduce,
    shard,
    shard_layer,
)

# Loading a large checkpoint on every rank can take minutes; a step never should.
STARTUP_TIMEOUT_S = 600
# Floats per rank in one call of the shared-memory all-reduce (512 rows of 2048); longer
# tensors go in parts.
SHM_CAP = 1 << 20
STEP_BYTES = 1 << 22            # room for a step's description (a few bytes per row)
TARGET = "target"               # the name of the model every rank loads first


@dataclass(frozen=True)
class WorkerArgs:
    model: str
    dtype: str
    max_len: int
    num_slots: int
    cpu_kernel: bool
    quantization: str | None
    kv_cache_dtype: str
    size: int
    addr: str
    port: int
    threads: int
    # files of SharedMemoryAllReduce's and SharedMemoryChannel's memory; None: gloo's
    # collectives
    shm: tuple[str, str] | None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerArgs:
        d = json.loads(text)
        return cls(**d | {"shm": tuple(d["shm"]) if d["shm"] else None})


def _shm_tensors(a: WorkerArgs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared memory of `a.shm`, mapped: the all-reduce's int64 words, the channel's bytes."""
    if a.shm is None:
        return None
    reduce_file, channel_file = a.shm
    return (torch.from_file(reduce_file, shared=True, size=shm_numel(a.size, SHM_CAP),
                            dtype=torch.int64),
            torch.from_file(channel_file, shared=True,
                            size=SharedMemoryChannel.HEADER + STEP_BYTES, dtype=torch.uint8))


def _make_shm_files(size: int) -> tuple[str, str]:
    """Two zero-filled files for the ranks' shared memory, in /dev/shm where it exists."""
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    files = []
    for nbytes in (8 * shm_numel(size, SHM_CAP), SharedMemoryChannel.HEADER + STEP_BYTES):
        fd, path = tempfile.mkstemp(prefix="specserve-tp-", dir=where)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        files.append(path)
    return files[0], files[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or a launcher like it) started this process: RANK
    and WORLD_SIZE are set, with MASTER_ADDR and MASTER_PORT."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _store(a: WorkerArgs, rank: int) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    return dist.TCPStore(a.addr, a.port, a.size, rank == 0, timeout=timeout,
                         wait_for_workers=False)


@dataclass
class _Link:
    """A rank's connections: the gloo group, the all-reduce of its shards' partial sums, and
    the shared-memory channel of the steps where the ranks use the CPU kernel."""
    group: dist.ProcessGroup
    all_reduce: Callable[[torch.Tensor], None]
    channel: SharedMemoryChannel | None


def _link(a: WorkerArgs, rank: int, store: dist.Store, check_peers: Callable[[], None],
          shm: tuple[torch.Tensor, torch.Tensor] | None, peers: tuple[int, ...] = (),
          parent: int = 0) -> _Link:
    """Join the gloo group (an object of its own: no process-global default group).
    `check_peers` raises when a rank that shared memory waits for is gone; the C side looks for
    the exit of `peers` (rank 0's workers) or of `parent` (a worker's rank 0) itself."""
    group = dist.ProcessGroupGloo(store, rank, a.size,
                                  datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    if shm is None:
        return _Link(group, gloo_all_reduce(group), None)
    lib = load_library()
    reduce = SharedMemoryAllReduce(lib, shm[0], rank, a.size, SHM_CAP, check_peers,
                                   peers=peers, parent=parent)
    return _Link(group, reduce, SharedMemoryChannel(lib, shm[1], check_peers))


def _load(a: WorkerArgs, path: str, max_len: int) -> torch.nn.Module:
    return load_model(path, resolve_dtype(a.dtype), torch.device("cpu"), max_len=max_len)


def _shard(a: WorkerArgs, rank: int, link: _Link, model: torch.nn.Module,
           quantization: str | None) -> torch.nn.Module:
    """This rank's shard of `model`, ready for inference on the CPU (a shard's all-reduces
    are the link's: every rank runs its models' steps in the same order)."""
    backend = Backend(torch.device("cpu"), resolve_dtype(a.dtype), a.cpu_kernel,
                      quantization=quantization)
    return backend.prepare(shard(model, rank, a.size, link.all_reduce))


def _rank0_alive(parent: int) -> None:
    if os.getppid() != parent:
        raise WorkerDied("rank 0 is gone; this worker stops")


def run_worker(a: WorkerArgs, rank: int) -> None:
    """A worker process started by rank 0 (`specserve.engine.worker`): rank `rank` until rank
    0 stops it (or is gone)."""
    torch.set_num_threads(a.threads)
    parent = os.getppid()
    _serve(a, rank, _store(a, rank), lambda: _rank0_alive(parent), _shm_tensors(a), parent)


def _serve(a: WorkerArgs, rank: int, store: dist.Store, check_peers: Callable[[], None],
           shm: tuple[torch.Tensor, torch.Tensor] | None = None, parent: int = 0) -> None:
    """Rank `rank`'s loop: load and shard the target, then run the steps rank 0 sends (of the
    target, or of a model it asked every rank to add: a sharded drafter). `shm`: the shared
    memory, mapped before this rank says it has loaded (rank 0 then removes its files)."""
    model = _load(a, a.model, a.max_len)
    store.set(f"loaded{rank}", "1")
    link = _link(a, rank, store, check_peers, shm, parent=parent)
    model = _shard(a, rank, link, model, a.quantization)
    models = {TARGET: (model, make_kv_cache(model, a.num_slots, a.max_len,
                                            kv_cache_dtype=a.kv_cache_dtype,
                                            loaded_dtype=resolve_dtype(a.dtype)))}
    heads: dict[str, tuple[nn.ModuleList, KVCache]] = {}   # sharded layers of drafter heads
    link.group.allreduce([torch.zeros(1)]).wait()                # ready
    with torch.inference_mode():
        while data := _receive(link):
            msg = json.loads(data)
            if "add" in msg:
                m = msg["add"]
                model = _shard(a, rank, link, _load(a, m["path"], m["max_len"]),
                               m["quantization"])
                models[m["name"]] = (model, make_kv_cache(model, a.num_slots, m["max_len"]))
                link.group.allreduce([torch.zeros(1)]).wait()    # added
                continue
            if "add_layers" in msg:
                heads[msg["add_layers"]["name"]] = _head_layers(a, rank, link,
                                                                msg["add_layers"])
                link.group.allreduce([torch.zeros(1)]).wait()    # added
                continue
            if "layer" in msg:
                _layer_step(link, *heads[msg["model"]], msg)
                continue
            model, cache = models[msg["model"]]
            ids, positions, md = step_inputs(msg, torch.device("cpu"))
            model(ids, positions, md, cache.layers)
    _shutdown(link)
    store.set(f"stopped{rank}", "1")


def _layer_spec(layer: DecoderLayer, args: LlamaArgs) -> dict:
    """What a worker needs to build a plain DecoderLayer of `layer`'s shape (a head's layer
    may be a subclass: its extras run on rank 0)."""
    at = layer.self_attn
    return {"args": dataclasses.asdict(dataclasses.replace(
                args, attention_bias=at.qkv_proj.bias is not None, qk_norm=at.q_norm is not None)),
            "attn_in_dim": at.qkv_proj.in_features}


def _plain_layer(spec: dict) -> DecoderLayer:
    return DecoderLayer(LlamaArgs(**spec["args"]), attn_in_dim=spec["attn_in_dim"])


def _sent_weights(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """The weights of a head's layer that the workers' shards use: all but the input norm
    (rank 0 sends the attention's input, `LeadLayer`)."""
    return {k: t for k, t in layer.state_dict().items() if not k.startswith("input_layernorm.")}


def _head_layers(a: WorkerArgs, rank: int, link: _Link, m: dict
                 ) -> tuple[nn.ModuleList, KVCache]:
    """A worker's shards of a drafter head's decoder layers (their weights broadcast by rank
    0, `TensorParallel.shard_head`) and their KV cache."""
    layers = nn.ModuleList(_plain_layer(spec) for spec in m["layers"])
    with torch.no_grad():
        for layer in layers:
            for t in _sent_weights(layer).values():
                link.group.broadcast(t, 0).wait()
    for layer in layers:
        shard_layer(layer, rank, a.size, link.all_reduce)
    backend = Backend(torch.device("cpu"), resolve_dtype(a.dtype), a.cpu_kernel,
                      quantization=m["quantization"])
    layers = backend.prepare(layers)
    at = layers[0].self_attn
    return layers, KVCache(len(layers), a.num_slots, at.num_kv_heads, m["max_len"], at.head_dim,
                           model_tensor(layers).dtype, torch.device("cpu"))


def _layer_step(link: _Link, layers: nn.ModuleList, cache: KVCache, msg: dict) -> None:
    """A worker's share of one step of a head's sharded layer: its inputs arrive through the
    all-reduce (rank 0 posts them, the workers zeros: a sum that is a broadcast)."""
    T, H, A, R = msg["rows"], msg["width"], msg["attn_in"], msg["rope"]
    flat = torch.zeros(T * (H + A + 2 * R), dtype=getattr(torch, msg["dtype"]))
    link.all_reduce(flat)
    x, attn_in, cs = flat.split([T * H, T * A, T * 2 * R])
    cs = cs.view(T, 2, R)
    i = msg["layer"]
    layers[i].step(x.view(T, H), (cs[:, 0:1], cs[:, 1:2]),
                   metadata_from_dict(msg["md"], torch.device("cpu")), cache.layers[i],
                   attn_in=attn_in.view(T, A))


def _shutdown(link: _Link) -> None:
    """Join the group's threads now: left to the interpreter's exit, gloo's could be torn down
    while still running (the process then aborts)."""
    with contextlib.suppress(RuntimeError):
        link.group.shutdown()


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


def _remove(files: tuple[str, str] | None) -> None:
    for f in files or ():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)


def _stop(links: list[_Link], workers: list, store: dist.Store, size: int,
          shm_files: tuple[str, str] | None = None) -> None:
    """Tell live workers to stop (an empty step, once they are linked), then reap them (or,
    those a launcher started, wait until they have left the group), then leave it."""
    _remove(shm_files)
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
    if links and not workers:                     # ranks a launcher started: none to reap
        with contextlib.suppress(RuntimeError):   # a rank that died does not hold us up
            store.wait([f"stopped{r}" for r in range(1, size)], datetime.timedelta(seconds=10))
    for link in links:
        _shutdown(link)


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot go on."""


def _check_alive(workers: list, doing: str) -> None:
    dead = [w for w in workers if not w.is_alive()]
    if dead:
        raise WorkerDied(
            f"tensor-parallel worker {dead[0].name} died during {doing} (exit code "
            f"{dead[0].exitcode}); the engine stops: see the worker's error above and "
            "restart it")


class _Worker:
    """A worker process (rank `rank`): `python -m specserve.engine.worker`, its arguments on
    its stdin, which then stays open as the pipe whose closing tells it rank 0 is gone."""

    def __init__(self, a: WorkerArgs, rank: int) -> None:
        self.name = f"specserve-tp-rank{rank}"
        # the package importable in the worker even where it is not installed (a checkout)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = os.environ | {"PYTHONPATH": os.pathsep.join(
            filter(None, [root, os.environ.get("PYTHONPATH")]))}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):    # not a launcher's rank
            env.pop(var, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "specserve.engine.worker",
                                      str(rank)], stdin=subprocess.PIPE, env=env)
        self.proc.stdin.write(a.to_json().encode() + b"\n")
        self.proc.stdin.flush()
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        if not self.is_alive():
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def kill(self) -> None:
        self.proc.kill()


class TensorParallel:
    """Rank 0's side: starts the workers (or joins those a launcher started), holds the
    group, sends each step."""

    def __init__(self, model: str, size: int, dtype: str, max_len: int, num_slots: int,
                 cpu_kernel: bool, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """Starts ranks 1..size-1 as worker processes; or, in a process that torchrun started
        (`torchrun_rank`), joins the ranks it started: rank 0 goes on as the engine's, every
        other rank serves it here and then ends its process (SystemExit(0))."""
        if size < 2:
            raise ValueError("tensor parallelism needs tensor_parallel_size >= 2")
        launched = torchrun_rank()
        if launched is not None and launched[1] != size:
            raise ValueError(f"the launcher started {launched[1]} processes (WORLD_SIZE) but "
                             f"tensor_parallel_size={size}; start one process per rank")
        # one process per machine's share of the cores: spawned here, each rank gets its share
        threads = (torch.get_num_threads() if launched else
                   max(1, torch.get_num_threads() // size))
        # the workers started here share this machine's memory; launched ones may not
        shm_files = (_make_shm_files(size)
                     if not launched and cpu_kernel and load_library() is not None else None)
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        self.args = WorkerArgs(model, dtype, max_len, num_slots, cpu_kernel, quantization,
                               kv_cache_dtype, size, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                               port, threads, shm_files)
        self._shm = _shm_tensors(self.args)
        self.workers: list[_Worker] = []
        self._links: list[_Link] = []                  # rank 0's link, once joined
        if launched is not None:
            # torchrun's store (its agent's, or rank 0's): the ranks meet there, under a prefix
            store, rank, _ = next(dist.rendezvous(
                "env://", timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S)))
            self.store = dist.PrefixStore("specserve", store)
            if rank:                    # a worker: serve rank 0's engine, then end the process
                _serve(self.args, rank, self.store, lambda: None)
                raise SystemExit(0)
        else:
            self.store = _store(self.args, 0)          # the server: before any worker
            try:
                self.workers = [_Worker(self.args, rank) for rank in range(1, size)]
            except BaseException:
                _remove(shm_files)
                raise
        self._stopper = weakref.finalize(self, _stop, self._links, self.workers, self.store,
                                         size, shm_files)

    def load(self) -> torch.nn.Module:
        """Rank 0's shard; returns once every worker has loaded and sharded its own."""
        model = _load(self.args, self.args.model, self.args.max_len)
        keys = [f"loaded{w}" for w in range(1, self.args.size)]
        self._poll(lambda: self.store.check(keys), "loading the model")
        _remove(self.args.shm)          # every worker has mapped it: nothing left behind
        # not a method: the link outlives this object (the finalizer that stops the workers
        # holds it) and must not keep it alive
        link = _link(self.args, 0, self.store,
                     functools.partial(_check_alive, self.workers, "a step"), self._shm,
                     peers=tuple(w.pid for w in self.workers))
        self._links.append(link)
        model = _shard(self.args, 0, link, model, self.args.quantization)
        self._collective(lambda: link.group.allreduce([torch.zeros(1)]), "loading the model")
        return model

    def add(self, name: str, path: str, max_len: int,
            quantization: str | None = None) -> ShardedModel:
        """Every rank loads its shard of the Llama-family model in `path` (a draft model of
        draft_tensor_parallel_size > 1) and a KV cache for it of `max_len` positions; returns
        rank 0's, whose forward runs the step on every rank."""
        link = self._links[0]
        self.send({"add": {"name": name, "path": path, "max_len": max_len,
                           "quantization": quantization}})
        model = _shard(self.args, 0, link, _load(self.args, path, max_len), quantization)
        self._collective(lambda: link.group.allreduce([torch.zeros(1)]), f"loading {path}")
        return ShardedModel(model, self, name)

    def shard_head(self, name: str, head: nn.Module, max_len: int,
                   backend: Backend) -> nn.Module:
        """`head` (in float32, as read) with its decoder layers sharded over every rank like
        the target's (a draft head of draft_tensor_parallel_size > 1), and a KV cache of
        `max_len` positions on each worker for them; embedding, norms, fc and lm_head stay
        whole here. Returns it prepared by `backend`; each step of one of its layers first
        sends the step and the layer's inputs to the workers."""
        layers = [m for m in head.modules() if isinstance(m, DecoderLayer)]
        # layer i is draft step i's (mod their number) and reads the head's KV cache layer i
        assert len(layers) == head.num_step_layers, "one decoder layer per step layer"
        check_divisible(head.args, self.args.size, "drafter's")
        specs = [_layer_spec(layer, head.args) for layer in layers]
        link = self._links[0]
        self.send({"add_layers": {"name": name, "max_len": max_len, "layers": specs,
                                  "quantization": backend.quantization}})
        for layer, spec in zip(layers, specs):
            state = layer.state_dict()
            with torch.device("meta"):               # the workers' layer, for its names and shapes
                plain = _plain_layer(spec)
            for k, t in _sent_weights(plain).items():
                if state[k].shape != t.shape:
                    raise ValueError(f"head layer {k}: {tuple(state[k].shape)} where its "
                                     f"config makes {tuple(t.shape)}")
                self._collective(lambda: link.group.broadcast(state[k].contiguous(), 0),
                                 "sending the head's weights")
        for layer in layers:
            shard_layer(layer, 0, self.args.size, link.all_reduce)
        head.tp_size = self.args.size
        head = backend.prepare(head)
        self._collective(lambda: link.group.allreduce([torch.zeros(1)]), "sharding the head")
        for i, layer in enumerate(m for m in head.modules() if isinstance(m, DecoderLayer)):
            layer.__class__ = _lead_class(type(layer))
            layer.lead = functools.partial(self._lead_step, name, i)
        return head

    def _lead_step(self, name: str, layer: int, x: torch.Tensor, attn_in: torch.Tensor,
                   cos_sin: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata) -> None:
        """Send a step of a sharded head layer with its inputs (the stream x [T, H], the
        attention's input [T, A], cos_sin: 2 x [T, 1, R]) to the workers."""
        (T, H), A, R = x.shape, attn_in.shape[-1], cos_sin[0].shape[-1]
        self.send({"model": name, "layer": layer, "rows": T, "width": H, "attn_in": A,
                   "rope": R, "dtype": str(x.dtype).removeprefix("torch."),
                   "md": metadata_dict(md)})
        parts = [x, attn_in, torch.cat(cos_sin, dim=-2).to(x.dtype)]
        self._links[0].all_reduce(torch.cat([p.reshape(-1) for p in parts]))

    def step(self, step: dict, model: str = TARGET) -> None:
        """Send a step (see `step_inputs`) of `model` to the workers; rank 0 then runs its own
        shard."""
        self.send({**step, "model": model})

    def send(self, message: dict) -> None:
        link, data = self._links[0], json.dumps(message).encode()
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


class LeadLayer(DecoderLayer):
    """Rank 0's shard of a head's decoder layer that every rank holds (`shard_head`): each
    step first sends itself to the workers (`lead`), whose shards then run it alongside. It
    sends the attention's input, normed here: a head's layer may norm it its own way (EAGLE-3
    reads a pair; EAGLE-1 does not norm)."""

    lead: Callable[..., None]

    def step(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
             md: AttentionMetadata | None, cache, mask: torch.Tensor | None = None,
             attn_in: torch.Tensor | None = None) -> torch.Tensor:
        if md is None or mask is not None:
            raise ValueError("a sharded head layer runs cached inference steps only")
        attn_in = self.input_layernorm(x) if attn_in is None else attn_in
        self.lead(x, attn_in, cos_sin, md)
        return super().step(x, cos_sin, md, cache, mask, attn_in)


@functools.cache
def _lead_class(cls: type[DecoderLayer]) -> type[LeadLayer]:
    return type(f"Lead{cls.__name__}", (LeadLayer, cls), {})


class ShardedModel(torch.nn.Module):
    """Rank 0's shard of a model added to every rank (`TensorParallel.add`): each forward
    first sends its step to the workers, rebuilt from the metadata (causal runs: a draft
    model's steps)."""

    def __init__(self, shard: torch.nn.Module, tp: TensorParallel, name: str) -> None:
        super().__init__()
        self.shard, self.name, self._tp = shard, name, tp
        self.args, self.tp_size = shard.args, shard.tp_size

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, md, kv_caches):
        if md.tree or not torch.equal(positions, md.positions):
            raise ValueError("a sharded drafter runs causal steps only")
        slots, pos = md.token_slots.tolist(), md.positions.tolist()
        firsts = [t for t in range(len(slots)) if t == 0 or slots[t] != slots[t - 1]]
        ends = firsts[1:] + [len(slots)]
        self._tp.step({"ids": ids.tolist(), "starts": [pos[t] for t in firsts],
                       "lens": [e - t for t, e in zip(firsts, ends)],
                       "slots": [slots[t] for t in firsts], "tree": None}, self.name)
        return self.shard(ids, positions, md, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.compute_logits(hidden)
