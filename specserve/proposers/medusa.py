"""Medusa: K heads on the target's last hidden state; head i drafts token t+i+2."""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.models.head_loader import load_head
from specserve.proposers.base import Proposal, ProposeBatch
from specserve.proposers.heads_common import check_k, last_hidden_rows
from specserve.token_tree import node_depths


class MedusaProposer:
    def __init__(self, config: SpeculativeConfig, engine) -> None:
        self.heads = load_head("medusa", config.model, engine.model, engine.device, engine.dtype,
                               engine.config.model_config.cpu_kernel)
        self.tree = config.token_tree()             # None: draft a chain
        if self.tree is None:
            check_k("medusa", config.num_speculative_tokens, self.heads.num_heads)
        elif self.tree.depth > self.heads.num_heads:
            raise ValueError(f"speculative_token_tree is {self.tree.depth} deep but this medusa "
                             f"checkpoint predicts {self.heads.num_heads} tokens; use a tree at "
                             f"most {self.heads.num_heads} deep")
        self.aux_hidden_layers = ()

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        if not batch.requests:
            return []
        hidden = batch.runner_output.hidden[last_hidden_rows(batch)]         # [B, H]
        logits = self.heads(hidden)                                          # [B, heads, V]
        if self.tree is None:
            drafts = logits.argmax(dim=-1).tolist()                          # [B, num_heads]
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

    def finish(self, request) -> None:
        pass
