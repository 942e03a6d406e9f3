"""What the KV-cached draft heads (EAGLE, EAGLE-3, MTP: specserve/methods/) share.

They share one interface: `fuse_target(hidden) -> h` turns the target's hidden states into the
head's input width; `forward(token_ids, h, positions, md, cache) -> out` runs the head's decoder
layer over (token at t+1, state at t) pairs; `logits(out)` gives target-vocabulary logits; `out`
is fed back as `h` for the next draft step. Module and parameter names follow the public
checkpoint formats, so that published heads load with at most a rename.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.models.layers import RMSNorm, Rotary
from specserve.models.llama import LlamaArgs


@dataclass(frozen=True)
class ChainParts:
    """A head's draft step as parts: state = fc([e_norm(embed(token)); h_norm(h)]) (either
    norm or fc may be absent), out = layer(state) (an EAGLE-3 layer attends over the normed
    pair and keeps h as its residual), logits = lm_head(final_norm(out)) over a draft
    vocabulary mapped to target ids by `d2t` (None: the target's)."""

    layer: nn.Module
    e_norm: RMSNorm | None
    h_norm: RMSNorm | None
    fc: nn.Module | None
    final_norm: RMSNorm | None
    d2t: torch.Tensor | None


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

    # KV-cached layers that take turns over the draft steps (MTP checkpoints with several)
    num_step_layers = 1
    tp_size = 1             # ranks its decoder layers are sharded over (draft tensor parallel)

    def step_head(self, step: int) -> StatefulHead:
        """The head that runs draft step `step` (0: the one fed the target's states) and
        reads its KV cache layer step % num_step_layers."""
        return self

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

    def chain_parts(self) -> ChainParts | None:
        """What one greedy draft step is made of, for a backend that drafts whole chains in
        compiled code (None: the proposer runs the PyTorch loop)."""
        return None

    def greedy_tokens_with_prob(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """greedy_tokens(out) and the head's probability of each: ([T], [T])."""
        logits = self.draft_logits(out).float()                              # [T, V]
        best = logits.max(dim=-1)
        return self.to_target_ids(best.indices), (best.values - logits.logsumexp(-1)).exp()
