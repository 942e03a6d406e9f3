"""The executor: the one place of the engine that knows about ranks. The engine asks it for
the loaded, prepared target and its KV cache, for what a drafter needs to load its model or
shard its head, and wraps each step in it; with tensor_parallel_size > 1 the executor holds the
worker processes (`tensor_parallel.TensorParallel`) and sends each target step to them."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from torch import nn

from specserve import methods
from specserve.config import ModelConfig, SpeculativeConfig
from specserve.engine.tensor_parallel import TensorParallel
from specserve.kv_cache import KVCache
from specserve.models.backend import Backend, make_kv_cache
from specserve.models.llama import LlamaArgs
from specserve.models.loader import load_model
from specserve.models.tensor_parallel import check_divisible


class Executor:
    """One process: the target loaded and prepared here."""

    # why prefix caching cannot run on this executor (None: it can)
    no_prefix_caching: str | None = None

    def __init__(self, mc: ModelConfig, backend: Backend, max_len: int, num_slots: int) -> None:
        self.mc, self.backend, self.max_len, self.num_slots = mc, backend, max_len, num_slots

    def load_target(self) -> nn.Module:
        return self.backend.prepare(load_model(self.mc.model, self.backend.dtype,
                                               self.backend.device, max_len=self.max_len),
                                    greedy_screen=True)

    def kv_cache(self, model: nn.Module) -> KVCache:
        return make_kv_cache(model, self.num_slots, self.max_len, self.backend.cuda_graphs,
                             self.mc.kv_cache_dtype, self.backend.dtype)

    def draft_hooks(self, spec: SpeculativeConfig, draft_backend: Backend) -> dict:
        """DraftContext's load_sharded and shard_head (None: drafters run whole here)."""
        return {"load_sharded": None, "shard_head": None}

    def before_step(self, step: dict) -> None:
        """Called by the runner with each target step's description before it runs."""

    def scope(self) -> contextlib.AbstractContextManager:
        """Wraps each engine step."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class TensorParallelExecutor(Executor):
    """Ranks 0..N-1 each hold a shard of the target (rank 0 here, the others in worker
    processes); a drafter of draft_tensor_parallel_size > 1 is sharded over them too."""

    no_prefix_caching = "the other ranks' KV lives in their own processes"

    def __init__(self, mc: ModelConfig, backend: Backend, max_len: int, num_slots: int) -> None:
        super().__init__(mc, backend, max_len, num_slots)
        self.tp = TensorParallel(mc.model, mc.tensor_parallel_size, mc.dtype, max_len,
                                 num_slots, mc.cpu_kernel, mc.quantization, mc.kv_cache_dtype)

    def load_target(self) -> nn.Module:
        return self.tp.load()

    def draft_hooks(self, spec: SpeculativeConfig, draft_backend: Backend) -> dict:
        if spec.draft_tensor_parallel_size == 1:
            return super().draft_hooks(spec, draft_backend)
        return {"load_sharded": functools.partial(self.tp.add, "draft",
                                                  quantization=spec.quantization),
                "shard_head": functools.partial(self.tp.shard_head, "head",
                                                backend=draft_backend)}

    def before_step(self, step: dict) -> None:
        self.tp.step(step)

    def scope(self) -> contextlib.AbstractContextManager:
        return self.tp.own_cores()

    def close(self) -> None:
        self.tp.close()


def make_executor(mc: ModelConfig, spec: SpeculativeConfig | None, backend: Backend,
                  max_len: int, num_slots: int, hf: dict) -> Executor:
    """The executor for mc.tensor_parallel_size, checked first: a size that cannot split the
    model fails before any process starts."""
    size = mc.tensor_parallel_size
    draft_size = spec.draft_tensor_parallel_size if spec else 1
    if draft_size not in (1, size):
        raise ValueError(f"draft_tensor_parallel_size={draft_size} must be 1 or equal to "
                         f"tensor_parallel_size={size} (vLLM's rule)")
    if draft_size > 1 and not methods.get(spec.method).shards:
        raise ValueError(f"draft_tensor_parallel_size={draft_size} shards the drafters of "
                         f"{', '.join(methods.sharded_methods())} only; {spec.method!r} runs "
                         "whole on rank 0 beside the sharded target: use "
                         "draft_tensor_parallel_size=1")
    if size == 1:
        return Executor(mc, backend, max_len, num_slots)
    if backend.device.type != "cpu":
        raise ValueError(f"tensor_parallel_size={size} runs on the CPU (gloo) only; on "
                         f"{backend.device.type} use tensor_parallel_size=1")
    check_divisible(LlamaArgs.from_hf_config(hf, str(Path(mc.model) / "config.json")), size)
    return TensorParallelExecutor(mc, backend, max_len, num_slots)

