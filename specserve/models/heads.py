"""Draft heads that read the target's hidden states: ONE definition each, used by the proposers
(inference) and by train/ (training).

Module and parameter names follow the public checkpoint formats so that published heads load
with at most a rename (see `specserve/models/head_loader.py`):
- Medusa (vLLM layout): `blocks.{i}.layers.{j}` residual SiLU blocks, `lm_heads.{i}`;
- MLP speculator (IBM): `emb.{i}`, `proj.{i}`, `ln.{i}`, `head.{i}`, optional `ln0`;
- EAGLE (yuhuili EAGLE-1): `fc` over [token embedding; hidden], `layers.0` without its input norm;
- EAGLE-3 (speculators): `fc` fusing three target layers, `layers.0` with `input_layernorm` on
  the embedding and `hidden_norm` on the hidden state, `norm`, `lm_head` over a draft vocabulary,
  `d2t` (draft id -> target id offset);
- MTP (DeepSeek style): `enorm`, `hnorm`, `eh_proj`, a decoder block, `shared_head.norm`.

The stateful heads (EAGLE, EAGLE-3, MTP) share one interface:
`fuse_target(hidden) -> h` turns the target's hidden states into the head's input width;
`forward(token_ids, h, positions, md, cache) -> out` runs the head's decoder layer over
(token at t+1, state at t) pairs; `logits(out)` gives target-vocabulary logits; `out` is fed back
as `h` for the next draft step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.cpu_kernel import HeadChain, kernel_step
from specserve.models.layers import MLP, Attention, AttentionMetadata, RMSNorm, Rotary
from specserve.models.llama import DecoderLayer, LlamaArgs


# ---- Medusa -------------------------------------------------------------------------------
class ResidualBlocks(nn.Module):
    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K heads on the target's last hidden state; head i predicts the token i+2 positions after
    the state (the target's own lm_head predicts the next one). Each head has its own lm_head,
    or all share `shared_lm_head` (vLLM's `original_lm_head`: the target's, so the checkpoint
    holds only the residual blocks)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int,
                 shared_lm_head: nn.Module | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlocks(hidden, num_layers) for _ in range(num_heads))
        self.shared = shared_lm_head is not None
        self.lm_heads = nn.ModuleList(shared_lm_head if self.shared else
                                      nn.Linear(hidden, vocab, bias=False)
                                      for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, H] -> logits [B, num_heads, V]
        states = torch.stack([block(hidden) for block in self.blocks], dim=1)   # [B, n, H]
        if self.shared:                  # one matmul for every head
            return self.lm_heads[0](states)
        return torch.stack([lm(states[:, i]) for i, lm in enumerate(self.lm_heads)], dim=1)


# ---- MLP speculator -----------------------------------------------------------------------
class SpeculatorLayerNorm(nn.Module):
    """IBM's LayerNormParameterized without mean subtraction: x / rms(x) * weight + bias."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """Stage i: state = gelu(ln_i(proj_i(state) + c * emb_i(token))); logits = head_i(state)."""

    def __init__(self, emb_dim: int, inner_dim: int, vocab: int, n_predict: int,
                 tie_weights: bool = False, scale_input: bool = False) -> None:
        super().__init__()
        self.n_predict = n_predict
        n = 1 if tie_weights else n_predict
        self.emb = nn.ModuleList(nn.Embedding(vocab, inner_dim) for _ in range(n))
        self.proj = nn.ModuleList(
            [nn.Linear(emb_dim, inner_dim, bias=False)]
            + [nn.Linear(inner_dim, inner_dim, bias=False)
               for _ in range(min(1, n_predict - 1) if tie_weights else n_predict - 1)])
        self.head = nn.ModuleList(nn.Linear(inner_dim, vocab, bias=False) for _ in range(n))
        self.ln = nn.ModuleList(SpeculatorLayerNorm(inner_dim) for _ in range(n))
        self.ln0 = SpeculatorLayerNorm(emb_dim, affine=False) if scale_input else None
        state_weight = 0.5 ** (0.5 / n_predict)
        emb_weight = math.sqrt((1 - state_weight ** 2) * (inner_dim / 2))
        self.emb_scale = emb_weight / state_weight      # ln is scale-invariant: fold weights

    def stage(self, i: int, state: torch.Tensor, token_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """state: [B, emb_dim] (stage 0) or [B, inner]; token_ids: [B] -> (state, logits [B, V])."""
        e = min(i, len(self.emb) - 1)
        if i == 0 and self.ln0 is not None:
            state = self.ln0(state) / math.sqrt(2)
        state = self.proj[min(i, len(self.proj) - 1)](state) + self.emb[e](token_ids) * self.emb_scale
        state = F.gelu(self.ln[e](state))
        return state, self.head[e](state)


# ---- EAGLE / EAGLE-3 / MTP ------------------------------------------------------------------
class StatefulHead(nn.Module):
    """What the KV-cached heads share: the layer shape, rotary tables, the embedding (and
    lm_head) they borrow from the target unless their checkpoint has their own."""

    def __init__(self, args: LlamaArgs, embed: nn.Embedding, lm_head: nn.Linear | None) -> None:
        super().__init__()
        self.args = args
        self.rotary = Rotary(args.head_dim, args.max_position_embeddings, args.rope_theta,
                             args.rope_scaling)
        self.embed_tokens = embed
        if lm_head is not None:
            self.lm_head = lm_head

    def fuse_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [T, H] as this head's input state."""
        return hidden

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the head's own vocabulary (the target's unless overridden)."""
        return self.logits(out)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Head vocabulary ids -> target ids (identity unless overridden)."""
        return ids

    def greedy_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The most likely next token (a target id) for each output row [T, H]: [T]."""
        return self.to_target_ids(self.draft_logits(out).argmax(dim=-1))

    def top_tokens(self, out: torch.Tensor, k: int) -> torch.Tensor:
        """The k most likely next tokens (target ids, best first) for each row [T, H]: [T, k]."""
        return self.to_target_ids(self.draft_logits(out).topk(k, dim=-1).indices)

    def kernel_chain(self, cache: tuple[torch.Tensor, torch.Tensor]) -> HeadChain | None:
        """Greedy chain drafting in compiled code for this head with KV cache `cache`, or None
        (then the proposer runs the PyTorch loop)."""
        return None

    def _chain(self, layer: nn.Module, e_norm: RMSNorm | None, h_norm: RMSNorm | None,
               fc: nn.Module | None, final_norm: RMSNorm | None, d2t: torch.Tensor | None,
               cache: tuple[torch.Tensor, torch.Tensor]) -> HeadChain | None:
        """The HeadChain of these parts where all run on the CPU kernel with one eps (the C
        code norms with the layer's), else None."""
        norms = [n for n in (e_norm, h_norm, final_norm) if n is not None]
        packed = [getattr(m, "kernel_weight", None) for m in (self.lm_head, fc) if m is not None]
        if (layer.cpu_layer is None or any(w is None for w in packed)
                or any(n.lib is None for n in norms)
                or len({n.eps for n in norms} | {layer.post_attention_layernorm.eps}) != 1):
            return None
        e_w, h_w, final_w = (None if n is None else n.weight for n in (e_norm, h_norm, final_norm))
        return HeadChain(layer.cpu_layer, self.embed_tokens.weight, e_w, h_w,
                         None if fc is None else fc.kernel_weight, None if fc is None else fc.bias,
                         final_w, self.lm_head.kernel_weight, self.lm_head.out_features, d2t,
                         self.rotary.cos_sin, cache)

    def greedy_tokens_with_prob(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """greedy_tokens(out) and the head's probability of each: ([T], [T])."""
        logits = self.draft_logits(out).float()                              # [T, V]
        best = logits.max(dim=-1)
        return self.to_target_ids(best.indices), (best.values - logits.logsumexp(-1)).exp()


class EagleHead(StatefulHead):
    """EAGLE-1: out = layer(fc([embed(token); h])); logits = target lm_head(out)."""

    def __init__(self, args: LlamaArgs, fc_bias: bool, embed: nn.Embedding,
                 lm_head: nn.Linear) -> None:
        super().__init__(args, embed, lm_head)
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        layer = DecoderLayer(args)
        layer.input_layernorm = nn.Identity()       # EAGLE-1 drops the first layer's input norm
        self.layers = nn.ModuleList([layer])

    def forward(self, token_ids, h, positions, md: AttentionMetadata | None, cache):
        x = self.fc(torch.cat([self.embed_tokens(token_ids), h], dim=-1))
        return self.layers[0](x, self.rotary.tables(positions, x.dtype), md, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(out)

    def kernel_chain(self, cache: tuple[torch.Tensor, torch.Tensor]) -> HeadChain | None:
        return self._chain(self.layers[0], None, None, self.fc, None, None, cache)


class Eagle3DecoderLayer(nn.Module):
    """Attention over [input_layernorm(embedding); hidden_norm(hidden)] (2H wide), residual on
    the hidden state, then the usual MLP."""

    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        H = a.hidden_size
        self.input_layernorm = RMSNorm(H, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, a.rms_norm_eps)
        self.self_attn = Attention(H, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                   bias=False, qk_norm=False, eps=a.rms_norm_eps, in_dim=2 * H)
        self.post_attention_layernorm = RMSNorm(H, a.rms_norm_eps)
        self.mlp = MLP(H, a.intermediate_size)
        self.cpu_layer = None           # see DecoderLayer

    def forward(self, emb, hidden, cos_sin, md, cache):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        if self.cpu_layer is not None and kernel_step(md, x, self.cpu_layer.lib):
            return self.cpu_layer(hidden, cos_sin, md, cache, attn_in=x)
        x = hidden + self.self_attn(x, cos_sin, md, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(StatefulHead):
    """EAGLE-3: fc fuses the target's aux hidden states (3H -> H) for the first draft step; the
    head's own pre-norm output feeds later steps; its lm_head covers a draft vocabulary mapped to
    target ids by `d2t` (target id = draft id + d2t[draft id])."""

    def __init__(self, args: LlamaArgs, num_aux: int, target_hidden: int, draft_vocab: int,
                 target_vocab: int, embed: nn.Embedding) -> None:
        H = args.hidden_size
        super().__init__(args, embed, nn.Linear(H, draft_vocab, bias=False))
        self.fc = nn.Linear(num_aux * target_hidden, H, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(args)])
        self.norm = RMSNorm(H, args.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.target_vocab = target_vocab

    def fuse_target(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden)

    def forward(self, token_ids, h, positions, md, cache):
        emb = self.embed_tokens(token_ids)
        return self.layers[0](emb, h, self.rotary.tables(positions, emb.dtype), md, cache)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))                                  # [T, draft_vocab]

    def kernel_chain(self, cache: tuple[torch.Tensor, torch.Tensor]) -> HeadChain | None:
        layer = self.layers[0]
        return self._chain(layer, layer.input_layernorm, layer.hidden_norm, None, self.norm,
                           self.d2t, cache)

    def draft_to_target(self) -> torch.Tensor:
        """The target id of each draft-vocabulary id: [draft_vocab]."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        draft = self.draft_logits(out)                                       # [T, draft_vocab]
        if draft.shape[-1] == self.target_vocab and not self.d2t.any():
            return draft
        full = draft.new_full((draft.shape[0], self.target_vocab), float("-inf"))
        return full.index_copy(1, self.draft_to_target(), draft)


class MTPLayer(StatefulHead):
    """DeepSeek-style multi-token prediction layer stored in the target checkpoint:
    out = block(eh_proj([enorm(embed(token)); hnorm(h)])); logits = lm_head(shared_head.norm(out))."""

    def __init__(self, args: LlamaArgs, embed: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__(args, embed, lm_head)
        H = args.hidden_size
        self.enorm = RMSNorm(H, args.rms_norm_eps)
        self.hnorm = RMSNorm(H, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = DecoderLayer(args)
        self.shared_head_norm = RMSNorm(H, args.rms_norm_eps)

    def forward(self, token_ids, h, positions, md, cache):
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(token_ids)), self.hnorm(h)], -1))
        return self.block(x, self.rotary.tables(positions, x.dtype), md, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.shared_head_norm(out))

    def kernel_chain(self, cache: tuple[torch.Tensor, torch.Tensor]) -> HeadChain | None:
        return self._chain(self.block, self.enorm, self.hnorm, self.eh_proj,
                           self.shared_head_norm, None, cache)
