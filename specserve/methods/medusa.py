"""Medusa (Cai et al. 2024; vLLM and FasterDecoding formats): K residual heads on the target's
last hidden state, head i drafting token t+i+2; a chain of their argmaxes, or a tree of their
top candidates."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import SpeculativeConfig
from specserve.methods.base import (
    DraftContext,
    MethodSpec,
    Proposal,
    ProposeBatch,
    ProposerBase,
)
from specserve.methods.checkpoints import assign_weights, check_target, write_head
from specserve.methods.heads_common import last_hidden_rows
from specserve.models.loader import load_hf_config, read_state_dict
from specserve.token_tree import node_depths


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


def new_head(target: nn.Module, k: int, draft_vocab: int | None = None,
             token_counts=None) -> MedusaHeads:
    """Heads that share the target's (frozen) lm_head: small files."""
    a = target.args
    return MedusaHeads(a.hidden_size, a.vocab_size, k, num_layers=1,
                       shared_lm_head=target.lm_head)


def read(path: str | Path, target: nn.Module) -> MedusaHeads:
    d = Path(path)
    cfg = load_hf_config(d)
    state = read_state_dict(d)
    if "medusa_num_heads" in cfg:                       # FasterDecoding layout
        n, layers = cfg["medusa_num_heads"], cfg.get("medusa_num_layers", 1)
        renamed = {}
        for k, v in state.items():
            # medusa_lm_head.pt's keys, with or without the model's medusa_head. prefix
            m = re.match(r"(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$", k)
            if not m:
                raise ValueError(f"{d}: tensor {k!r} is not part of the FasterDecoding Medusa "
                                 "layout ({i}.{j}.linear.weight/bias, {i}.{layers}.weight)")
            i, j, kind = int(m[1]), int(m[2]), m[3]
            renamed[f"lm_heads.{i}.{kind}" if j == layers else f"blocks.{i}.layers.{j}.{kind}"] = v
        state = renamed
    else:
        n, layers = cfg.get("num_heads", 0), cfg.get("num_hidden_layers", 1)
    if not n:
        raise ValueError(f"{d / 'config.json'}: no Medusa head count (num_heads or "
                         "medusa_num_heads)")
    hidden, vocab = target.args.hidden_size, target.args.vocab_size
    check_target(str(d), "vocab_size", state["lm_heads.0.weight"].shape[0]
                  if "lm_heads.0.weight" in state else vocab, vocab)
    if not cfg.get("original_lm_head"):
        heads = MedusaHeads(hidden, vocab, n, layers)
        assign_weights(heads, state, str(d))
        return heads
    shared = target.lm_head                 # a copy in the checkpoint wins, as in vLLM
    if "lm_head.weight" in state:
        check_target(str(d), "vocab_size", state["lm_head.weight"].shape[0], vocab)
        shared = nn.Linear(hidden, vocab, bias=False)
        shared.weight.data.copy_(state.pop("lm_head.weight"))
    heads = MedusaHeads(hidden, vocab, n, layers, shared_lm_head=shared)
    assign_weights(heads, state, str(d), optional=("lm_heads.",))
    return heads


def write(head: MedusaHeads, out: Path, target_dir: Path, dtype: torch.dtype) -> None:
    cfg = {"architectures": ["MedusaModel"], "num_heads": head.num_heads,
           "num_hidden_layers": len(head.blocks[0].layers),
           "hidden_size": head.lm_heads[0].in_features,
           "vocab_size": head.lm_heads[0].out_features, "original_lm_head": head.shared}
    tensors = {k: v for k, v in head.state_dict().items()
               if not (head.shared and k.startswith("lm_heads."))}
    write_head(out, cfg, tensors, dtype)


def loss(head: MedusaHeads, x, pos, h, aux, logp, k: int, distill):
    """Head i on h_t against the target's distribution for token t+i+2."""
    S = x.shape[1]
    losses = [distill(lm(block(h[:, :S - i - 1])), logp[:, i + 1:])
              for i, (block, lm) in enumerate(zip(head.blocks, head.lm_heads))]
    total = sum(losses) / len(losses)
    return total, {"loss": total.item(), "kl_head0": losses[0].item()}


class MedusaProposer(ProposerBase):
    def __init__(self, config: SpeculativeConfig, ctx: DraftContext) -> None:
        self.heads = ctx.backend.prepare(read(config.model, ctx.target))
        self.modules = {"heads": self.heads}
        self.tree = config.token_tree()             # None: draft a chain
        if self.tree is not None and self.tree.depth > self.heads.num_heads:
            raise ValueError(f"speculative_token_tree is {self.tree.depth} deep but this medusa "
                             f"checkpoint predicts {self.heads.num_heads} tokens; use a tree at "
                             f"most {self.heads.num_heads} deep")

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        if not batch.requests:
            return []
        hidden = batch.runner_output.hidden[last_hidden_rows(batch)]         # [B, H]
        logits = self.heads(hidden)                                          # [B, heads, V]
        if self.tree is None:
            best = logits.argmax(dim=-1)                                     # [B, num_heads]
            n = max(batch.max_num_tokens)
            if n > best.shape[1]:                 # K a multiple of the heads: they run in turn
                best = best[:, [i % best.shape[1] for i in range(n)]]      # [B, K]
            drafts = best.tolist()
            return [Proposal(d[:k]) for d, k in zip(drafts, batch.max_num_tokens)]
        # Each head's candidates do not depend on the drafts before them: a node at depth d
        # with rank r is head d-1's r-th best token.
        top = logits.topk(1 + max(self.tree.ranks), dim=-1).indices.tolist()  # [B, heads, r]
        out = []
        for k, cand in zip(batch.max_num_tokens, top):
            tree = self.tree.truncated(k)
            toks = [cand[d - 1][rank] for d, rank in zip(node_depths(tree.parents), tree.ranks)]
            out.append(Proposal(toks, parents=None if tree.is_chain else list(tree.parents)))
        return out


def default_k(path: str) -> int | None:
    """One draft per head."""
    cfg = load_hf_config(path)
    return cfg.get("num_heads") or cfg.get("medusa_num_heads")


SPEC = MethodSpec(
    name="medusa", build=MedusaProposer, summary="Medusa heads on the target's last hidden state",
    detect=("medusa",), needs_model=True, reads_hidden_states=True, drafts_trees=True,
    default_k=default_k, repeats_layers=True, new_head=new_head, read=read, write=write, loss=loss)
