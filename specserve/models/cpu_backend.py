"""The CPU backends' side of a model: its modules' inference variants, which own the packed
weights and the compiled paths (the model classes themselves are plain PyTorch).

`use_decode_linears` turns a loaded model into them in place: every nn.Linear becomes a
DecodeLinear (its weight packed once for the C kernel, or reordered for oneDNN), and with the
kernel every RMSNorm a KernelRMSNorm, every decoder layer its KernelLayer variant (a few-row
cached step in one C call) and a LlamaForCausalLM a KernelLlama (the whole step in one C call).
The variants are subclasses that put the compiled path in front of the class's own, swapped
in by changing the instance's class as PyTorch's `fully_shard` does: parameters, their names
and the PyTorch fallback (long prompt chunks, training) stay the plain module's.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from specserve.config import check_quantization
from specserve.kernels.cpu import (
    CpuLayer,
    GreedyScreen,
    HeadChain,
    LlamaChain,
    LlamaForward,
    SharedMemoryAllReduce,
    kernel_step,
    linear_rows,
    load_library,
    max_rows,
    pack_weight,
    rms_norm_rows,
)
from specserve.models.heads import StatefulHead
from specserve.models.layers import AttentionMetadata, RMSNorm, model_tensor
from specserve.models.llama import DecoderLayer, LlamaForCausalLM

# A vocabulary projection at least this wide gets an int8 screen for greedy rows
# (DecodeLinear.greedy_logits): below it the full product costs little anyway.
SCREEN_MIN_VOCAB = 16384


class DecodeLinear(nn.Module):
    """Inference-only CPU linear over a copy of its weight packed for few-row inputs.

    MKL's sgemm (behind F.linear) is slow for the few-row matmuls of decoding: a verify step
    of 1+k rows cost well over a one-row decode step. With `lib` (the compiled CPU kernel),
    every input goes through the kernel over the packed copy (`kernel_weight`, which
    `CpuLayer` reads too), and the module keeps no other: a weight is held once, in the bytes
    the kernel streams (bfloat16 where bfloat16 holds it, int8 with `quantization`). Without
    the kernel, oneDNN with the weight reordered once for a multi-row layout keeps the cost
    nearly flat from 1 to about 8 rows, and a one-row step is cheaper too; in bfloat16 it also
    beats F.linear's kernel (`specserve bench latency --pytorch-path` compares the paths).
    `screen`: greedy rows through an int8 screen (GreedyScreen); `tied`: the weight is also
    an embedding's, which the screen then reads its candidates from.
    """

    PACK_ROWS = 16

    def __init__(self, linear: nn.Linear, lib=None, bf16_inputs: bool = False,
                 quantization: str | None = None, screen: bool = False,
                 tied: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lib = lib
        self.bias = linear.bias
        self.screen = None
        if lib is not None:
            # A plain attribute, so that module.to() and .float() (a head's prepare, which may
            # hold the target's lm_head) never convert it out of the kernel's layout.
            self.weight = None
            self.kernel_weight = pack_weight(linear.weight, lib.specserve_block(),
                                             pairs=bf16_inputs, quantization=quantization,
                                             absmax=getattr(linear, "row_absmax", None))
            if screen and quantization is None and linear.bias is None:
                # a tied weight stays as the embedding: the screen reads candidates there
                self.screen = GreedyScreen(lib, linear.weight, self.kernel_weight,
                                           rows=linear.weight if tied else None)
            return
        self.weight = linear.weight                  # same Parameter: ties stay tied
        self.kernel_weight = None
        # An opaque oneDNN tensor: a plain attribute, since module.to() cannot move it. The
        # layout is chosen for PACK_ROWS-row inputs; any hint > 1 gives the fast few-row
        # kernels (a plain to_mkldnn() copy runs 5 rows at 2x the cost of one).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                              self.PACK_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None:
            # Longer inputs (prompt chunks) too: a tile's weights stay in cache while its rows
            # pass, and no float32 copy of the weight is kept for them.
            y = linear_rows(self.lib, x.reshape(-1, self.in_features), self.kernel_weight,
                            self.bias, self.out_features)                  # [N, out]
            return y.view(*x.shape[:-1], self.out_features)
        if x.dim() == 2:                                 # [T, in]: the engine's flat batch
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed,
                                               self.bias, "none", [], "")     # [N, out]
        return y.view(*x.shape[:-1], self.out_features)

    def greedy_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> forward's [N, out] where a row's largest may be (the same bits),
        -inf elsewhere: what a greedy pick needs, through the int8 screen where there is one."""
        return self.screen(x) if self.screen is not None and x.dim() == 2 else self.forward(x)


def use_decode_linears(model: nn.Module, cpu_kernel: bool = True,
                       quantization: str | None = None,
                       greedy_screen: bool = False) -> nn.Module:
    """Swap every nn.Linear of a float32 or bfloat16 CPU inference model for a DecodeLinear
    (in place). Other cases keep nn.Linear: CUDA has cuBLAS; float16, and bfloat16 without the
    kernel on a CPU without native bfloat16 instructions, have no fast oneDNN kernel.

    With `cpu_kernel`, every linear and the small inputs of RMSNorms go through the compiled
    CPU kernel (KernelRMSNorm), and every decoder layer becomes its KernelLayer variant (a
    CpuLayer for its few-row cached steps); without a C compiler that is skipped with a
    warning. A bfloat16
    model becomes float32 then (its values unchanged) and its few-row matrix products take
    their inputs in bfloat16 (AVX512-BF16 dot products where the CPU has them): norms,
    attention, the KV cache and the sums stay float32. A LlamaForCausalLM becomes a KernelLlama
    that runs its whole cached step in one call (`cpu_forward`).
    `quantization="int8"` (kernel only) packs every linear's weight as int8 with one scale per
    output column; "q8_0", "q4_1", "q4_0" in llama.cpp's blocks, an lm_head in q8_0 with the
    4-bit ones (a GGUF's vocabulary projection is kept at 8 bits or more: it decides every
    token, and its one matrix is a fifth of a small model's bytes). `greedy_screen`: an
    unquantized lm_head of at least SCREEN_MIN_VOCAB columns gets an int8 screen for greedy
    rows (`DecodeLinear.greedy_logits`)."""
    w = model_tensor(model)
    check_quantization(quantization)
    if w.device.type != "cpu":
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} runs in the CPU kernel only; on "
                             f"{w.device.type} load the model unquantized (quantization=None)")
        return model
    lib = (load_library() if cpu_kernel and w.dtype in (torch.float32, torch.bfloat16)
           else None)
    if quantization is not None and lib is None:
        raise ValueError(f"quantization={quantization!r} needs the CPU kernel (cpu_kernel=True, "
                         "dtype float32 or bfloat16, and a C compiler with OpenMP); the PyTorch "
                         "path multiplies unquantized weights only")
    bf16_inputs = lib is not None and w.dtype == torch.bfloat16 and quantization is None
    if lib is None and not _onednn_linear_available(w.dtype):
        return model
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                # packed one at a time, from the weights as loaded: no float32 copy of the
                # whole model is ever held beside the packed one
                q = ("q8_0" if name == "lm_head" and quantization in ("q4_0", "q4_1")
                     else quantization)
                # AMX multiplies bfloat16 pairs at about the cost of their bytes, in its own
                # summation order: no screen there
                screen = (greedy_screen and name == "lm_head"
                          and child.out_features >= SCREEN_MIN_VOCAB
                          and not (bf16_inputs and lib is not None and lib.specserve_amx()))
                setattr(module, name, DecodeLinear(child, lib, bf16_inputs, q, screen,
                                                   id(child.weight) in embeddings))
    if lib is not None:
        model.float()          # what the kernel reads besides the packed weights is float32
        for module in model.modules():
            if (isinstance(module, DecoderLayer) and not isinstance(module, KernelLayer)
                    and CpuLayer.supports(module)):
                module.__class__ = _kernel_layer_class(type(module))
                module.cpu_layer = CpuLayer(module, lib)
            elif type(module) is RMSNorm and module.weight.is_contiguous():
                module.__class__ = KernelRMSNorm
                module.lib = lib
        for module in model.modules():
            if type(module) is LlamaForCausalLM:
                module.__class__ = KernelLlama
                module.cpu_forward = llama_forward(module)
    return model


def _onednn_linear_available(dtype: torch.dtype) -> bool:
    try:
        ops = (torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight)
        if not torch.backends.mkldnn.is_available() or any(op is None for op in ops):
            return False
        if dtype == torch.bfloat16:
            return torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return dtype == torch.float32
    except (AttributeError, RuntimeError):
        return False


class KernelRMSNorm(RMSNorm):
    """RMSNorm whose inputs of at most max_rows(lib) rows are normed in the kernel."""

    lib: ctypes.CDLL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= max_rows(self.lib) * x.shape[-1]:
            return rms_norm_rows(self.lib, x, self.weight, self.eps)
        return super().forward(x)


class KernelLayer(DecoderLayer):
    """A decoder layer (or a subclass: EAGLE-3's) whose cached steps of at most max_rows(lib)
    rows run in one C call (`cpu_layer`; None: the PyTorch path, as tests force it)."""

    cpu_layer: CpuLayer | None

    def step(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
             md: AttentionMetadata | None, cache, mask: torch.Tensor | None = None,
             attn_in: torch.Tensor | None = None) -> torch.Tensor:
        if self.cpu_layer is not None and kernel_step(md, x, self.cpu_layer.lib):
            return self.cpu_layer(x, cos_sin, md, cache, attn_in=attn_in,
                                  reduce=self.all_reduce)
        return super().step(x, cos_sin, md, cache, mask, attn_in)


@functools.cache
def _kernel_layer_class(cls: type[DecoderLayer]) -> type[KernelLayer]:
    return KernelLayer if cls is DecoderLayer else type(f"Kernel{cls.__name__}",
                                                         (KernelLayer, cls), {})


class KernelLlama(LlamaForCausalLM):
    """A Llama-family model whose cached steps of at most max_rows(lib) rows run whole in one
    C call (`cpu_forward`; None where a layer has no CpuLayer or a shard's all-reduce is
    gloo's)."""

    cpu_forward: LlamaForward | None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata | None = None,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                aux_layers: tuple[int, ...] = (), mask: torch.Tensor | None = None):
        if self.cpu_forward is not None and kernel_step(md, input_ids, self.cpu_forward.lib):
            return self.cpu_forward(input_ids, positions, md, kv_caches, aux_layers)
        return super().forward(input_ids, positions, md, kv_caches, aux_layers, mask)


def llama_forward(model: LlamaForCausalLM) -> LlamaForward | None:
    layers = [getattr(layer, "cpu_layer", None) for layer in model.layers]
    reduce = model.layers[0].all_reduce
    if (None in layers or not isinstance(model.norm, KernelRMSNorm)
            # a shard sums in the call only through shared memory; gloo's: layer by layer
            or (reduce is not None and not isinstance(reduce, SharedMemoryAllReduce))):
        return None
    return LlamaForward(layers, model.embed_tokens.weight, model.norm.weight, model.norm.eps,
                        model.rotary.cos_sin, reduce)


def compiled_chain(model: nn.Module, caches: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> LlamaChain | HeadChain | None:
    """Greedy chain drafting in one C call per step for a draft model or a head on the kernel,
    with its KV caches `caches` (a head: one layer's), or None (then the proposer runs the
    PyTorch loop)."""
    if isinstance(model, KernelLlama):
        packed = model.lm_head.kernel_weight if isinstance(model.lm_head, DecodeLinear) else None
        layers = [getattr(layer, "cpu_layer", None) for layer in model.layers]
        if (packed is None or None in layers or not isinstance(model.norm, KernelRMSNorm)
                or model.tp_size > 1
                or len({model.norm.eps, *(x.post_attention_layernorm.eps
                                          for x in model.layers)}) != 1):
            return None
        return LlamaChain(layers, model.embed_tokens.weight, model.norm.weight, packed,
                          model.args.vocab_size, model.rotary.cos_sin, caches)
    parts = model.chain_parts() if isinstance(model, StatefulHead) else None
    if parts is None:
        return None
    norms = [n for n in (parts.e_norm, parts.h_norm, parts.final_norm) if n is not None]
    linears = [m for m in (model.lm_head, parts.fc) if m is not None]
    if (getattr(parts.layer, "cpu_layer", None) is None or model.tp_size > 1
            or not all(isinstance(m, DecodeLinear) and m.kernel_weight is not None
                       for m in linears)
            or not all(isinstance(n, KernelRMSNorm) for n in norms)
            # the C code norms with the layer's eps
            or len({n.eps for n in norms} | {parts.layer.post_attention_layernorm.eps}) != 1):
        return None
    fc = parts.fc
    e_w, h_w, final_w = (None if n is None else n.weight
                         for n in (parts.e_norm, parts.h_norm, parts.final_norm))
    return HeadChain(parts.layer.cpu_layer, model.embed_tokens.weight, e_w, h_w,
                     None if fc is None else fc.kernel_weight, None if fc is None else fc.bias,
                     final_w, model.lm_head.kernel_weight, model.lm_head.out_features,
                     parts.d2t, model.rotary.cos_sin, caches[0])
