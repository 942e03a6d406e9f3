"""EAGLE (Li et al. 2024, yuhuili EAGLE-1 format): a decoder layer over fc([embed(x_t+1); h_t])
of the target's last hidden state, drafting with the target's lm_head; trained with KL to the
target plus feature regression to h_t+1 (smooth L1), as in EAGLE."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
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
from specserve.models.heads import ChainParts, StatefulHead
from specserve.models.layers import AttentionMetadata
from specserve.models.llama import DecoderLayer, LlamaArgs
from specserve.models.loader import fuse_hf_names, load_hf_config, read_state_dict


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

    def chain_parts(self) -> ChainParts:
        return ChainParts(self.layers[0], None, None, self.fc, None, None)


def new_head(target: nn.Module, k: int, draft_vocab: int | None = None,
             token_counts=None) -> EagleHead:
    return EagleHead(layer_args(target.args), fc_bias=True, embed=target.embed_tokens,
                     lm_head=target.lm_head)


def read(path: str | Path, target: nn.Module) -> EagleHead:
    d = Path(path)
    cfg = load_hf_config(d)
    src = str(d / "config.json")
    args = head_args(cfg, target.args, src)
    check_target(src, "hidden_size", args.hidden_size, target.args.hidden_size)
    check_target(src, "vocab_size", args.vocab_size, target.args.vocab_size)
    state = {k.removeprefix("model."): v for k, v in read_state_dict(d).items()}
    emb = embedding_of(state, target, args.vocab_size, args.hidden_size)
    head = EagleHead(args, fc_bias="fc.bias" in state, embed=emb, lm_head=target.lm_head)
    assign_weights(head, fuse_hf_names(state, 1), str(d),
            optional=("embed_tokens.", "lm_head.", "rotary."))
    return head


def write(head: EagleHead, out: Path, target_dir: Path, dtype: torch.dtype) -> None:
    a = head.args
    tensors = {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias}
    tensors |= layer_tensors(head.layers[0], a, "layers.0.")
    write_head(out, a.to_hf_config() | {"num_hidden_layers": 1}, tensors, dtype)


def loss(head: EagleHead, x, pos, h, aux, logp, k: int, distill):
    # pairs (state at t, token t+1) for t = 0..S-2
    out = head(x[:, 1:], head.fuse_target(h[:, :-1]), pos[:, :-1], None, None)  # [B, S-1, H]
    kl = distill(head.logits(out), logp[:, 1:])
    reg = F.smooth_l1_loss(out.float(), h[:, 1:].float())
    total = kl * 0.1 + reg
    return total, {"kl": kl.item(), "feature_l1": reg.item(), "loss": total.item()}


def build(config: SpeculativeConfig, ctx: DraftContext) -> HeadProposer:
    return HeadProposer(config, ctx, read(config.model, ctx.target))


SPEC = MethodSpec(
    name="eagle", build=build, summary="EAGLE head on the target's last hidden state",
    detect=("eagle",), needs_model=True, reads_hidden_states=True, drafts_trees=True,
    steps_drafts=True, shards=True, default_k=speculators_k, recurrent=True, new_head=new_head,
    read=read, write=write, loss=loss)
