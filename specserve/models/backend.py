"""The backend a model runs on, chosen once when the engine is built and shared by its
drafters: CUDA, the CPU kernel (specserve/kernels/cpu), or PyTorch on the CPU (oneDNN linears
where they exist)."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

import torch
from torch import nn

from specserve.config import resolve_dtype
from specserve.kernels.cpu import (
    HeadChain,
    LlamaChain,
    LlamaForward,
    cpu_features,
    max_rows,
)
from specserve.kv_cache import KVCache
from specserve.models.cpu_backend import (
    DecodeLinear,
    compiled_chain,
    llama_forward,
    use_decode_linears,
)
from specserve.models.cuda_graphs import CudaGraphs, HeadChainGraphs
from specserve.models.heads import StatefulHead
from specserve.models.layers import model_tensor
from specserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Backend:
    device: torch.device
    dtype: torch.dtype
    cpu_kernel: bool            # run few-row CPU steps in the compiled kernel where it builds
    cuda_graphs: bool = False   # replay few-row CUDA steps of target and draft from graphs
    quantization: str | None = None     # "int8": weights quantized for the CPU kernel

    def prepare(self, model: nn.Module, greedy_screen: bool = False) -> nn.Module:
        """`model` (any device and dtype) moved to this backend's and set up for inference on
        it (packed weights for the kernel or oneDNN on the CPU); `greedy_screen`: its lm_head
        screened for greedy rows (a target's: drafters pick their drafts in their C chains)."""
        model = use_decode_linears(model.to(device=self.device, dtype=self.dtype).eval(),
                                   self.cpu_kernel, self.quantization, greedy_screen)
        if self.device.type == "cpu":
            release_freed_memory()
        return model

    def graphs(self, model: nn.Module, cache: KVCache, max_batch: int) -> CudaGraphs | None:
        """CUDA graphs of `model`'s few-row cached steps over `cache`, or None (eager)."""
        return CudaGraphs(model, cache, max_batch) if self.cuda_graphs else None

    def head_graphs(self, head: nn.Module, cache: KVCache, max_batch: int
                    ) -> HeadChainGraphs | None:
        """CUDA graphs of a prepared head's greedy draft chains over `cache`, or None (eager)."""
        return HeadChainGraphs(head, cache, max_batch) if self.cuda_graphs else None

    def chain(self, model: nn.Module, caches: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> LlamaChain | HeadChain | None:
        """Greedy chain drafting in one compiled call per step for a prepared draft model or
        head with KV caches `caches` (a head: its first layer's), or None (the proposer's
        PyTorch loop)."""
        return compiled_chain(model, caches) if self.device.type == "cpu" else None

    def forward(self, model: nn.Module) -> LlamaForward | None:
        """A prepared stack's whole cached step (`embed_tokens`, every layer of `layers`, the
        final `norm`; `rotary` as it will stay) in one compiled call, or None (layer by layer).
        ids, positions [T], metadata, caches -> final hidden states [T, H]."""
        return llama_forward(model) if self.device.type == "cpu" else None

    def describe(self, model: nn.Module) -> str:
        """Which path a prepared model's steps take (the engine logs it)."""
        w = model_tensor(model)
        if w.device.type != "cpu":
            if self.cuda_graphs and isinstance(model, LlamaForCausalLM):
                return f"{w.device.type} (CUDA graphs)"
            if self.cuda_graphs and isinstance(model, StatefulHead):
                return f"{w.device.type} (eager; CUDA graphs of greedy chains)"
            return f"{w.device.type} (eager)"
        linears = [m for m in model.modules() if isinstance(m, DecodeLinear)]
        lib = next((m.lib for m in linears if m.lib is not None), None)
        if lib is not None:
            kinds = {m.kernel_weight.dtype for m in linears}
            quant = (", int8 weights" if torch.int8 in kinds else
                     ", llama.cpp block weights" if torch.uint8 in kinds else "")
            return (f"cpu kernel ({cpu_features(lib)}{quant}, "
                    f"steps up to {max_rows(lib)} rows)")
        return "pytorch cpu (oneDNN linears)" if linears else "pytorch cpu"


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim): the checkpoint's
    tensors and the packing's temporaries, freed by now, would otherwise stay resident."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):      # not glibc: its allocator returns memory itself
        pass


def make_kv_cache(model: nn.Module, num_slots: int, max_len: int,
                  scratch_slot: bool = False, kv_cache_dtype: str = "auto",
                  loaded_dtype: torch.dtype | None = None) -> KVCache:
    """A KV cache for `model`'s layers (its own share of the KV heads when it is one rank's
    tensor-parallel shard) in `kv_cache_dtype`; "auto": the dtype the model was loaded in
    (`loaded_dtype`; the CPU kernel computes a bfloat16 model in float32 but keeps its cache
    in bfloat16, as vLLM's "auto" and llama.cpp's F16 cache do), else the one it computes in."""
    a = model.args
    p = model_tensor(model)
    dtype = (resolve_dtype(kv_cache_dtype) if kv_cache_dtype != "auto"
             else loaded_dtype or p.dtype)
    return KVCache(a.num_hidden_layers, num_slots, a.num_key_value_heads // model.tp_size,
                   max_len, a.head_dim, dtype, p.device, scratch_slot)
