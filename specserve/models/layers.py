"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding, attention, MLP.

Inference runs on a flat ragged batch: all new tokens of all requests in one `[num_tokens, ...]`
tensor, request-major, with an `AttentionMetadata` describing where each request's tokens sit.
Training runs on a dense `[batch, seq, ...]` tensor with plain causal attention (metadata None).

These are plain PyTorch modules: the backend (models/backend.py) swaps in its variants for
inference (models/cpu_backend.py: packed linears, the C kernel's layers and steps).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel, in float32 inside on CUDA; the unfused bfloat16 path below is seven
        # kernels, which on a GPU cost more than the layer's products at batch 1.
        if x.dtype == torch.float32 or x.is_cuda:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the factor cos and sin are scaled by, as
    transformers computes them for rope types default, linear, dynamic (equal to default within
    the model's context, which is all the engine runs), llama3 and yarn."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    old_len = scaling["original_max_position_embeddings"]
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, factor, old_len, scaling)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, factor: float, old_len: int,
          p: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): dimensions that turn fewer than beta_slow times over the
    original context are interpolated, those turning more than beta_fast times kept, a linear
    ramp between; cos and sin scaled by 0.1 ln(factor) + 1 (or the given attention_factor)."""
    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp                                 # 1: extrapolate (the original frequency)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by position (rotate-half layout, as in HF Llama)."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_len, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)                        # [max_len, head_dim // 2]
        # rotate_half(x) * sin == roll(x, head_dim // 2) * signed_sin: the sign of the first
        # half is folded into the table, so applying rotary is three kernels, not six. cos and
        # signed sin sit side by side so that one index fetches both.
        cos = torch.cat([freqs, freqs], -1).cos() * attention_factor
        signed_sin = torch.cat([-freqs, freqs], -1).sin() * attention_factor
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
        mask = md.attn_mask()
        if q.is_cuda and mask is not None:
            o = grouped_attention(qp, keys, values, mask, self.scale)      # [B, Q, H, D]
        else:
            o = F.scaled_dot_product_attention(
                qp.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale,
                enable_gqa=True).transpose(1, 2)                           # [B, Q, H, D]
        o = o.reshape(B * Q, self.q_size)
        return o if md.pad_index is None else o[md.pad_index]    # [T, H * D]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Masked GQA attention as one fused kernel: each KV head's group of query heads becomes
    rows of one query head. (CUDA's fused kernels that take a mask do not take `enable_gqa`;
    its fallback copies the keys and values out per query head in ~10 kernels a layer.)
    q: [B, Q, H, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, Q, L] bool. Returns [B, Q, H, D]."""
    B, Q, H, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    # row j * Q + i of KV head h: query i of head h * group + j
    qg = q.transpose(1, 2).reshape(B, Hkv, group * Q, D)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(1, 1, group, 1),
                                       scale=scale)                # [B, Hkv, group * Q, D]
    return o.unflatten(2, (group, Q)).permute(0, 3, 1, 2, 4).reshape(B, Q, H, D)


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


def model_tensor(model: nn.Module) -> torch.Tensor:
    """A tensor of `model` with the device and dtype it computes in: its first parameter (or
    buffer: kernel-packed weights are neither)."""
    return next(itertools.chain(model.parameters(), model.buffers()))
