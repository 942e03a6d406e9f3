"""IBM MLP speculator: staged MLPs over the target's last hidden state and the previous token."""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.models.head_loader import load_head
from specserve.proposers.base import Proposal, ProposeBatch
from specserve.proposers.heads_common import check_k, last_hidden_rows


class MLPSpeculatorProposer:
    def __init__(self, config: SpeculativeConfig, engine) -> None:
        self.spec = load_head("mlp_speculator", config.model, engine.model, engine.device,
                              engine.dtype, engine.config.model_config.cpu_kernel)
        check_k("mlp_speculator", config.num_speculative_tokens, self.spec.n_predict)
        self.device = engine.device
        self.aux_hidden_layers = ()

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        if not batch.requests:
            return []
        state = batch.runner_output.hidden[last_hidden_rows(batch)]          # [B, H]
        tokens = torch.tensor([r.all_token_ids[-1] for r in batch.requests], device=self.device)
        drafts = []
        for i in range(max(batch.max_num_tokens)):
            state, logits = self.spec.stage(i, state, tokens)
            tokens = logits.argmax(dim=-1)                                   # [B]
            drafts.append(tokens)
        drafts = torch.stack(drafts, dim=1).tolist()                         # [B, k]
        return [Proposal(d[:k]) for d, k in zip(drafts, batch.max_num_tokens)]

    def finish(self, request) -> None:
        pass
