"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding, attention, MLP.

Inference runs on a flat ragged batch: all new tokens of all requests in one `[num_tokens, ...]`
tensor, request-major, with an `AttentionMetadata` describing where each request's tokens sit.
Training runs on a dense `[batch, seq, ...]` tensor with plain causal attention (metadata None).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import check_quantization
from specserve.kernels.cpu import (
    GROUP,
    CpuLayer,
    linear_rows,
    load_library,
    max_rows,
    pack_weight,
    rms_norm_rows,
)


@dataclass(slots=True)
class AttentionMetadata:
    """Where the new tokens of one engine step go; built once per step, shared by all layers."""

    token_slots: torch.Tensor     # [num_tokens] long: KV-cache slot of each token's request
    positions: torch.Tensor       # [num_tokens] long: position of each token in its sequence
    slot_ids: torch.Tensor        # [batch] long: KV-cache slot of each request
    # slot of request 0 (the batch-1 fast path slices a view); None where the slot must be
    # read from slot_ids (CUDA graphs: their replays feed new slots)
    first_slot: int | None
    batch_size: int
    max_query_len: int
    max_kv_len: int               # longest context after this step's writes
    # [num_tokens] flat index of each token in a padded [batch * max_query_len] layout;
    # None when all requests have max_query_len new tokens (no padding needed).
    pad_index: torch.Tensor | None
    # [batch, 1, max_query_len, max_kv_len] bool, True = may attend; None for batch-1 decode,
    # and for causal steps until `attn_mask()` first builds it from `starts`.
    mask: torch.Tensor | None
    # True when rows are draft-tree nodes that see only their ancestors (not causal runs)
    tree: bool = False
    starts: list[int] | None = None   # causal steps: each request's first new position
    _row_mask: torch.Tensor | None = field(default=None, repr=False)

    def attn_mask(self) -> torch.Tensor | None:
        """The mask, built on first use: the CPU kernel's steps never need one."""
        if self.mask is None and self.starts is not None:
            qpos = (torch.tensor(self.starts, device=self.positions.device)[:, None]
                    + torch.arange(self.max_query_len, device=self.positions.device))  # [B, Q]
            self.mask = (torch.arange(self.max_kv_len, device=qpos.device)[None, None, :]
                         <= qpos[:, :, None]).unsqueeze(1)                          # [B, 1, Q, L]
        return self.mask

    def row_mask(self) -> torch.Tensor:
        """The mask as one row per token, [num_tokens, max_kv_len] bool contiguous (built once):
        what the CPU kernel reads for draft-tree steps."""
        if self._row_mask is None:
            m = self.attn_mask()[:, 0].flatten(0, 1)                       # [B * Q, L]
            self._row_mask = (m if self.pad_index is None else m[self.pad_index]).contiguous()
        return self._row_mask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.lib = None         # the CPU kernel, set by use_decode_linears for inference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None and x.numel() <= max_rows(self.lib) * x.shape[-1]:
            return rms_norm_rows(self.lib, x, self.weight, self.eps)
        if x.dtype == torch.float32:                 # one fused kernel
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2]; supports the default and llama3 rope types."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by position (rotate-half layout, as in HF Llama)."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_len, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)                        # [max_len, head_dim // 2]
        # rotate_half(x) * sin == roll(x, head_dim // 2) * signed_sin: the sign of the first
        # half is folded into the table, so applying rotary is three kernels, not six. cos and
        # signed sin sit side by side so that one index fetches both.
        cos = torch.cat([freqs, freqs], -1).cos()
        signed_sin = torch.cat([-freqs, freqs], -1).sin()
        self.register_buffer("cos_sin", torch.stack([cos, signed_sin], 1),
                             persistent=False)               # [max_len, 2, head_dim]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for `positions` [..., seq] as [..., seq, 1, head_dim] views of one
        [..., seq, 2, head_dim] tensor; once per forward."""
        cs = self.cos_sin.index_select(0, positions.reshape(-1)).view(*positions.shape, 2, -1)
        if cs.dtype != dtype:
            cs = cs.to(dtype)
        return cs[..., 0:1, :], cs[..., 1:2, :]


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # x: [..., seq, heads, head_dim]
    cos, signed_sin = cos_sin
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class Attention(nn.Module):
    """GQA self-attention with fused q/k/v, optional q/k bias (Qwen2) and q/k RMSNorm (Qwen3)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, qk_norm: bool, eps: float, in_dim: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # in_dim: input width when it differs from the output (EAGLE-3 attends over 2H inputs)
        self.qkv_proj = nn.Linear(in_dim or hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.scale = head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata | None,
                cache: tuple[torch.Tensor, torch.Tensor] | list | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """cache: this layer's KV cache when md is given; in training (md None) optionally the
        list of earlier unrolled passes' keys and values (see `_unrolled`), appended to.
        mask: dense training only, [S, S] bool (True = may attend) instead of causal."""
        lead = x.shape[:-1]                                      # [T] or [B, S]
        q, k, v = self.project(x, cos_sin)
        if md is None:                                           # training
            if cache:
                o = self._unrolled(q, k, v, cache)
            else:                                                # dense: causal or `mask`
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                    is_causal=mask is None, scale=self.scale, enable_gqa=True)  # [B, H, S, D]
            if cache is not None:
                cache.append((k, v))
            return self.o_proj(o.transpose(1, 2).reshape(*lead, self.q_size))
        return self.o_proj(self._cached(q, k, v, md, cache))

    def project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [..., H, D], rotated keys and values [..., Hkv, D] of x [..., in]."""
        lead = x.shape[:-1]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[..., self.q_size + self.kv_size:].view(*lead, Hkv, D)
        if self.q_norm is None:      # q and k are adjacent: rotate them in one pass
            qk = apply_rotary(qkv[..., :self.q_size + self.kv_size].view(*lead, H + Hkv, D),
                              cos_sin)
            return qk[..., :H, :], qk[..., H:, :], v
        q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (apply_rotary(self.q_norm(q.view(*lead, H, D)), cos_sin),
                apply_rotary(self.k_norm(k.view(*lead, Hkv, D)), cos_sin), v)

    def project_kv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [..., Hkv, D] of x [..., in] without its queries (DFlash
        injects the target's context into a layer this way)."""
        lead = x.shape[:-1]
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        if w is None:           # packed for the CPU kernel: the k and v columns only
            kv = self.qkv_proj.forward_from(x, self.q_size)                # [..., 2 * Hkv * D]
        else:
            kv = F.linear(x, w[self.q_size:], None if b is None else b[self.q_size:])
        k, v = kv.view(*lead, 2, self.num_kv_heads, self.head_dim).unbind(-3)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, cos_sin), v

    def _unrolled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """EAGLE-3's training-time test: pass j of a head unrolled over a sequence, whose row i
        is the (j+1)-th draft after position i, attends as the drafting chain does: to rows 0..i
        of the first pass (the target-fed context) and to row i of passes 1..j (its own earlier
        drafts). q: [B, n, H, D]; k, v: [B, n, Hkv, D]; `earlier`: the keys and values of passes
        0..j-1, each with at least n rows (row i = position i)."""
        n, j = q.shape[1], len(earlier)
        keys = torch.cat([e[0][:, :n] for e in earlier] + [k], 1)       # [B, n * (j+1), Hkv, D]
        values = torch.cat([e[1][:, :n] for e in earlier] + [v], 1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        own = torch.eye(n, dtype=torch.bool, device=q.device)
        mask = torch.cat([causal] + [own] * j, 1)                          # [n, n * (j+1)]
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
            scale=self.scale, enable_gqa=True)                             # [B, H, n, D]

    def _cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]; cache tensors: [num_slots, Hkv, max_len, D]
        k_cache, v_cache = cache                  # held in bfloat16 with kv_cache_dtype
        k_cache[md.token_slots, :, md.positions] = k.to(k_cache.dtype)
        v_cache[md.token_slots, :, md.positions] = v.to(v_cache.dtype)
        B, Q, L = md.batch_size, md.max_query_len, md.max_kv_len
        if B == 1 and md.first_slot is not None:
            s = md.first_slot
            keys, values = k_cache[s:s + 1, :, :L], v_cache[s:s + 1, :, :L]   # views
        else:
            keys, values = k_cache[md.slot_ids, :, :L], v_cache[md.slot_ids, :, :L]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if md.pad_index is None:
            qp = q.view(B, Q, self.num_heads, self.head_dim)
        else:
            qp = q.new_zeros(B * Q, self.num_heads, self.head_dim)
            qp[md.pad_index] = q
            qp = qp.view(B, Q, self.num_heads, self.head_dim)
        o = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=md.attn_mask(), scale=self.scale,
            enable_gqa=True)                                     # [B, H, Q, D]
        o = o.transpose(1, 2).reshape(B * Q, self.q_size)
        return o if md.pad_index is None else o[md.pad_index]    # [T, H * D]


class MLP(nn.Module):
    """SwiGLU with fused gate/up weights."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
    """

    PACK_ROWS = 16

    def __init__(self, linear: nn.Linear, lib=None, bf16_inputs: bool = False,
                 quantization: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lib = lib
        self.bias = linear.bias
        if lib is not None:
            # A plain attribute, so that module.to() and .float() (a head's prepare, which may
            # hold the target's lm_head) never convert it out of the kernel's layout.
            self.weight = None
            self.kernel_weight = pack_weight(linear.weight, lib.specserve_block(),
                                             pairs=bf16_inputs, int8=quantization == "int8")
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

    def forward_from(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """forward(x)[..., first:] (the tail of a fused projection: DFlash's keys and values),
        reading only those columns' weights when `first` starts a packed group of columns."""
        width = GROUP * self.lib.specserve_block() if self.lib is not None else 0
        if not width or first % width:
            return self(x)[..., first:]
        bias = None if self.bias is None else self.bias[first:]
        y = linear_rows(self.lib, x.reshape(-1, self.in_features),
                        self.kernel_weight[first // width:], bias, self.out_features - first)
        return y.view(*x.shape[:-1], self.out_features - first)


def model_tensor(model: nn.Module) -> torch.Tensor:
    """A tensor of `model` with the device and dtype it computes in: its first parameter (or
    buffer: kernel-packed weights are neither)."""
    return next(itertools.chain(model.parameters(), model.buffers()))


def use_decode_linears(model: nn.Module, cpu_kernel: bool = True,
                       quantization: str | None = None) -> nn.Module:
    """Swap every nn.Linear of a float32 or bfloat16 CPU inference model for a DecodeLinear
    (in place). Other cases keep nn.Linear: CUDA has cuBLAS; float16, and bfloat16 without the
    kernel on a CPU without native bfloat16 instructions, have no fast oneDNN kernel.

    With `cpu_kernel`, every linear and the small inputs of RMSNorms go through the compiled
    CPU kernel, and every decoder layer (a module with a `cpu_layer` slot) gets a CpuLayer for
    its few-row cached steps; without a C compiler that is skipped with a warning. A bfloat16
    model becomes float32 then (its values unchanged) and its few-row matrix products take
    their inputs in bfloat16 (AVX512-BF16 dot products where the CPU has them): norms,
    attention, the KV cache and the sums stay float32. A model with `kernel_forward`
    (LlamaForCausalLM) then runs its whole cached step in one call (`cpu_forward`).
    `quantization="int8"` (kernel only) packs every linear's weight as int8 with one scale per
    output column."""
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
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                # packed one at a time, from the weights as loaded: no float32 copy of the
                # whole model is ever held beside the packed one
                setattr(module, name, DecodeLinear(child, lib, bf16_inputs, quantization))
    if lib is not None:
        model.float()          # what the kernel reads besides the packed weights is float32
        for module in model.modules():
            if hasattr(module, "cpu_layer") and CpuLayer.supports(module):
                module.cpu_layer = CpuLayer(module, lib)
            elif isinstance(module, RMSNorm) and module.weight.is_contiguous():
                module.lib = lib
        for module in model.modules():
            if hasattr(module, "kernel_forward"):
                module.cpu_forward = module.kernel_forward()
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

