"""Medusa: K heads on the target's last hidden state; head i drafts token t+i+2."""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.models.head_loader import load_head
from specserve.proposers.base import Proposal, ProposeBatch
from specserve.proposers.heads_common import check_k, last_hidden_rows


class MedusaProposer:
    def __init__(self, config: SpeculativeConfig, engine) -> None:
        self.heads = load_head("medusa", config.model, engine.model, engine.device, engine.dtype)
        check_k("medusa", config.num_speculative_tokens, self.heads.num_heads)
        self.aux_hidden_layers = ()

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        if not batch.requests:
            return []
        hidden = batch.runner_output.hidden[last_hidden_rows(batch)]         # [B, H]
        drafts = self.heads(hidden).argmax(dim=-1).tolist()                  # [B, num_heads]
        return [Proposal(d[:k]) for d, k in zip(drafts, batch.max_num_tokens)]

    def finish(self, request) -> None:
        pass
