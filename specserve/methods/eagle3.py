"""EAGLE-3 (Li et al. 2025, speculators format; the yuhuili layout loads too): fc fuses three
target layers' hidden states, the decoder layer attends over [norm(embedding); norm(state)],
and an lm_head over a reduced draft vocabulary maps to target ids through `d2t`. Trained
unrolled for K draft steps (EAGLE-3's training-time test).

P-EAGLE (AWS, arXiv 2602.01469; vLLM's `eagle3` + `parallel_drafting`): the same head with a
learned `mask_hidden` and a mask token drafts K tokens in one pass, the K-1 mask rows after
the last pair standing in for the drafts not known yet; trained on the PARD layout."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specserve.config import SpeculativeConfig
from specserve.methods.base import DraftContext, MethodSpec
from specserve.methods.checkpoints import (
    assign_weights,
    check_target,
    embedding_of,
    head_args,
    layer_args,
    layer_tensors,
    speculators_k,
    write_head,
)
from specserve.methods.head_proposer import HeadProposer
from specserve.methods.parallel import (
    depth_weights,
    first_unused,
    mask_token_id,
    pard_mask,
)
from specserve.models.heads import ChainParts, StatefulHead
from specserve.models.layers import RMSNorm
from specserve.models.llama import DecoderLayer, LlamaArgs
from specserve.models.loader import fuse_hf_names, load_hf_config, read_state_dict


class Eagle3DecoderLayer(DecoderLayer):
    """Attention over [input_layernorm(embedding); hidden_norm(hidden)] (2H wide, no bias, no
    q/k norm whatever the target has), residual on the hidden state (on hidden_norm(hidden)
    with speculators' `norm_before_residual`), then the usual MLP."""

    def __init__(self, a: LlamaArgs, norm_before_residual: bool = False) -> None:
        super().__init__(dataclasses.replace(a, attention_bias=False, qk_norm=False),
                         attn_in_dim=2 * a.hidden_size)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, emb, hidden, cos_sin, md, cache, mask=None):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        return self.step(residual, cos_sin, md, cache, mask, attn_in=x)


class Eagle3Head(StatefulHead):
    """EAGLE-3: fc fuses the target's aux hidden states (3H -> H) for the first draft step; the
    head's own pre-norm output feeds later steps; its lm_head covers a draft vocabulary mapped to
    target ids by `d2t` (target id = draft id + d2t[draft id]). A P-EAGLE head (parallel
    drafting) also has `mask_hidden` [1, num_aux * target_hidden], the target features its
    mask rows stand on, and a mask token."""

    def __init__(self, args: LlamaArgs, num_aux: int, target_hidden: int, draft_vocab: int,
                 target_vocab: int, embed: nn.Embedding, mask_token_id: int | None = None,
                 variant: Eagle3Variant | None = None) -> None:
        H = args.hidden_size
        super().__init__(args, embed, nn.Linear(H, draft_vocab, bias=False))
        v = variant or Eagle3Variant()
        self.variant = v
        # norm_before_fc (gpt-oss heads): one norm over the concatenated target states;
        # fc_norm (EAGLE 3.1): one per target layer
        if v.norm_before_fc:
            self.input_norm = RMSNorm(num_aux * target_hidden, args.rms_norm_eps)
        if v.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, args.rms_norm_eps)
                                         for _ in range(num_aux))
        self.fc = nn.Linear(num_aux * target_hidden, H, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(args, v.norm_before_residual)])
        self.norm = RMSNorm(H, args.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.target_vocab = target_vocab
        self.mask_token_id = mask_token_id
        self.mask_hidden = (None if mask_token_id is None else
                            nn.Parameter(torch.randn(1, num_aux * target_hidden) * 0.02))
        self.depth_gamma: float | None = None      # training: P-EAGLE's copy weights (`loss`)
        self.chain_weight = 0.0                    # training: P-EAGLE also trains the chain

    def fuse_target(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        if self.variant.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.variant.fc_norm:
            parts = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([n(p) for n, p in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(aux_hidden)

    def mask_state(self) -> torch.Tensor:
        """The fused state of a mask row: fc(mask_hidden), [1, H] (vLLM projects it once)."""
        return self.fuse_target(self.mask_hidden)

    def forward(self, token_ids, h, positions, md, cache, mask=None):
        emb = self.embed_tokens(token_ids)
        out = self.layers[0](emb, h, self.rotary.tables(positions, emb.dtype), md, cache, mask)
        # norm_output (EAGLE 3.1): the next step reads the normed state the logits come from
        return self.norm(out) if self.variant.norm_output else out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.variant.norm_output:                          # `out` is normed already
            return self.lm_head(out)                                         # [T, draft_vocab]
        return self.lm_head(self.norm(out))                                  # [T, draft_vocab]

    def chain_parts(self) -> ChainParts | None:
        if self.variant.norm_output or self.variant.norm_before_residual:
            return None             # the compiled chain computes the original layout only
        layer = self.layers[0]
        return ChainParts(layer, layer.input_layernorm, layer.hidden_norm, None, self.norm,
                          self.d2t)

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


@dataclass(frozen=True)
class Eagle3Variant:
    """The norms EAGLE-3 checkpoints add to the original layout, by their config flags."""

    norm_before_fc: bool = False        # input_norm.weight over the concatenated target states
    fc_norm: bool = False               # fc_norm.{i}.weight, one per target layer (EAGLE 3.1)
    norm_output: bool = False           # the state fed back is norm(out) (EAGLE 3.1)
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(h) (speculators)

    @classmethod
    def from_config(cls, cfg: dict, source: str) -> Eagle3Variant:
        for key, value in cfg.items():
            if (isinstance(value, bool) and value and key not in _VARIANT_FLAGS
                    and key not in _HARMLESS_FLAGS):
                raise ValueError(f"{source}: EAGLE-3 flag {key}=true is not supported "
                                 f"(specserve reads {', '.join(_VARIANT_FLAGS)}); the head "
                                 "would compute something other than what was trained")
        return cls(**{k: bool(cfg.get(k)) for k in _VARIANT_FLAGS})


_VARIANT_FLAGS = tuple(f.name for f in dataclasses.fields(Eagle3Variant))
# true flags of published EAGLE-3 configs that change nothing specserve computes
_HARMLESS_FLAGS = frozenset({"has_no_defaults_at_init", "embed_requires_grad", "use_cache",
                             "return_dict", "tie_word_embeddings"})


PEAGLE_HINT = ("train one with `specserve train eagle3 --parallel --target DIR --out DIR` (from "
               "this head: --init DIR), or leave parallel_drafting off")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a new EAGLE-3 head reads: early, middle, late (2, L/2, L-3)."""
    return (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))


def new_head(target: nn.Module, k: int, draft_vocab: int | None = None,
             token_counts: np.ndarray | None = None, parallel: bool = False,
             depth_gamma: float | None = None, chain_weight: float = 0.0) -> Eagle3Head:
    """A fresh head; with `draft_vocab` < the target's vocabulary it keeps the `draft_vocab`
    target ids most frequent in `token_counts` [V] (as EAGLE-3 does); `parallel`: a P-EAGLE
    head, its mask token the lowest id unused in `token_counts`; `depth_gamma`: its training
    weighs the draft d tokens ahead by exp(-(d-1) / depth_gamma) (`loss`; default: all
    alike); `chain_weight`: a P-EAGLE head's training adds this times the chain's unrolled loss
    (one file serves both ways: drafting in one pass and as EAGLE-3's chain)."""
    a = target.args
    n = min(draft_vocab or a.vocab_size, a.vocab_size)
    if parallel and token_counts is None:
        raise ValueError("a P-EAGLE head needs token counts to choose its mask token")
    head = Eagle3Head(layer_args(a), 3, a.hidden_size, n, a.vocab_size, target.embed_tokens,
                      first_unused(token_counts) if parallel else None)
    if n < a.vocab_size:
        if token_counts is None:
            raise ValueError("a reduced eagle3 draft vocabulary needs token counts")
        ids = torch.from_numpy(np.sort(np.argsort(-token_counts, kind="stable")[:n]))
        head.d2t.copy_(ids - torch.arange(n, device=ids.device))
    head.aux_layers = default_aux_layers(a.num_hidden_layers)
    head.depth_gamma = depth_gamma
    if chain_weight and not parallel:
        raise ValueError("chain_weight is for a P-EAGLE head (parallel); a chain head trains "
                         "the chain alone")
    head.chain_weight = chain_weight
    return head


def read(path: str | Path, target: nn.Module) -> Eagle3Head:
    d = Path(path)
    cfg = load_hf_config(d)
    src = str(d / "config.json")
    layer_cfg = cfg.get("transformer_layer_config", cfg)
    args = head_args(layer_cfg, target.args, src)
    check_target(src, "vocab_size", args.vocab_size, target.args.vocab_size)
    state = {re.sub(r"^midlayer\.", "layers.0.", k.removeprefix("model.")): v
             for k, v in read_state_dict(d).items()}
    state.pop("t2d", None)
    draft_vocab = cfg.get("draft_vocab_size") or args.vocab_size
    target_hidden = cfg.get("target_hidden_size") or target.args.hidden_size
    num_aux = state["fc.weight"].shape[1] // target_hidden if "fc.weight" in state else 3
    emb = embedding_of(state, target, args.vocab_size, args.hidden_size)
    mask = (mask_token_id(cfg, str(d), PEAGLE_HINT) if "mask_hidden" in state else None)
    head = Eagle3Head(args, num_aux, target_hidden, draft_vocab, target.args.vocab_size, emb,
                      mask, Eagle3Variant.from_config(cfg, src))
    assign_weights(head, fuse_hf_names(state, 1), str(d), optional=("embed_tokens.", "rotary."))
    L = target.args.num_hidden_layers
    head.aux_layers = tuple(cfg.get("eagle_aux_hidden_state_layer_ids") or (2, L // 2, L - 3))
    return head


def write(head: Eagle3Head, out: Path, target_dir: Path, dtype: torch.dtype) -> None:
    a = head.args
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "draft_vocab_size": head.lm_head.out_features,
           "target_hidden_size": head.fc.in_features // 3,
           "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
           "transformer_layer_config": a.to_hf_config() | {"num_hidden_layers": 1}}
    cfg |= {k: v for k, v in dataclasses.asdict(head.variant).items() if v}
    tensors = {k: v for k, v in head.state_dict().items()
               if k.startswith(("fc.", "input_norm.", "fc_norm."))}
    tensors |= {"norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
                "d2t": head.d2t}
    if head.mask_hidden is not None:                         # P-EAGLE
        cfg["mask_token_id"] = head.mask_token_id
        tensors["mask_hidden"] = head.mask_hidden
    tensors |= layer_tensors(head.layers[0], a, "layers.0.")
    write_head(out, cfg, tensors, dtype)


def unrolled_drafts(head: nn.Module, x: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor,
                    k: int) -> list[torch.Tensor]:
    """An EAGLE-3 head unrolled for k draft steps over every position of x [B, S] at once (its
    training-time test): pass 0 reads the pairs (target aux state at t, token t+1); pass j feeds
    the head's own output of pass j-1 with token t+j+1, attending as the drafting chain would
    (`Attention._unrolled`). Returns k outputs; row t of output j [B, S-1-j, H] drafts token
    t+j+2, as the chain started after position t would."""
    earlier: list = []                       # keys and values of the passes so far
    tok = x[:, 1:]
    outs = [head(tok, head.fuse_target(aux[:, :-1]), pos[:, :-1], None, earlier)]
    for j in range(1, k):
        outs.append(head(tok[:, j:], outs[-1][:, :-1], pos[:, j:-1], None, earlier))
    return outs


def parallel_drafts(head: Eagle3Head, x: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor,
                    k: int) -> torch.Tensor:
    """A P-EAGLE head over every position of x [B, S] at once with k-1 mask copies (the PARD
    layout, `pard_mask`): row t of copy 0 is the pair (target aux state at t, token t+1), of
    copy c a mask row at the same position seeing pairs 0..t-c and one mask row per earlier
    copy, as mask c after pair t-c does when drafting. Returns [B, k, S-1, H]; row t of copy c
    drafts token t+2 (for t >= c)."""
    B, L = x.shape[0], x.shape[1] - 1
    h = torch.cat([head.fuse_target(aux[:, :-1]), head.mask_state().expand(B, (k - 1) * L, -1)],
                  1)                                                    # [B, k * L, H]
    tok = torch.cat([x[:, 1:], x.new_full((B, (k - 1) * L), head.mask_token_id)], 1)
    out = head(tok, h, pos[:, :-1].repeat(1, k), None, None, pard_mask(L, k, x.device))
    return out.view(B, k, L, -1)


def _chain_kls(head: Eagle3Head, x, aux, pos, logp, k: int, distill) -> list[torch.Tensor]:
    """The KL of each of the k unrolled draft steps (EAGLE-3's training-time test)."""
    outs = unrolled_drafts(head, x, aux, pos, k)
    return [distill(head.draft_logits(out), logp[:, j + 1:]) for j, out in enumerate(outs)]


def loss(head: Eagle3Head, x, pos, h, aux, logp, k: int, distill):
    """KL over the draft vocabulary (logp is the target's over it) at each of the k unrolled
    draft steps, averaged (P-EAGLE: of the k copies of one parallel pass, weighted by depth as
    `new_head`'s depth_gamma says, plus chain_weight x the unrolled chain's loss)."""
    if head.mask_hidden is None:
        kls = _chain_kls(head, x, aux, pos, logp, k, distill)
        total = sum(kls) / len(kls)
        values = {"kl" if j == 0 else f"kl_step{j + 1}": kl.item() for j, kl in enumerate(kls)}
        return total, values | {"loss": total.item()}
    outs = parallel_drafts(head, x, aux, pos, k)
    kls = [distill(head.draft_logits(outs[:, c, c:]), logp[:, 1 + c:]) for c in range(k)]
    w = depth_weights(k, head.depth_gamma)
    total = sum(wc * kl for wc, kl in zip(w.tolist(), kls)) / w.sum().item()
    values = {"kl": kls[0].item(), "kl_last": kls[-1].item()}
    if head.chain_weight:                    # the same file also drafts as a chain
        chain = _chain_kls(head, x, aux, pos, logp, k, distill)
        total = total + head.chain_weight * sum(chain) / len(chain)
        values["kl_chain_last"] = chain[-1].item()
    return total, values | {"loss": total.item()}


def build(config: SpeculativeConfig, ctx: DraftContext) -> HeadProposer:
    head = read(config.model, ctx.target)
    if config.parallel_drafting and head.mask_hidden is None:
        raise ValueError(f"{config.model}: parallel_drafting needs a P-EAGLE head (with "
                         f"mask_hidden and a mask token), and this EAGLE-3 head was not trained "
                         f"for it; {PEAGLE_HINT}")
    return HeadProposer(config, ctx, head)


SPEC = MethodSpec(
    name="eagle3", build=build,
    summary="EAGLE-3 head on three fused target layers, with a reduced draft vocabulary",
    detect=("eagle3", "eagle-3", "peagle"), needs_model=True, reads_hidden_states=True,
    drafts_trees=True, steps_drafts=True, drafts_in_parallel=True, shards=True,
    default_k=speculators_k, recurrent=True, new_head=new_head, read=read, write=write, loss=loss)
