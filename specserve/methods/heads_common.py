"""Helpers shared by the proposers that read the target's hidden states."""

from __future__ import annotations

import torch

from specserve.methods.base import ProposeBatch


def last_hidden_rows(batch: ProposeBatch) -> torch.Tensor:
    """Row of each drafting request's last verified token in the step's flat batch: [B] long."""
    out = batch.runner_output
    index = {id(r): i for i, r in enumerate(batch.step_requests)}
    rows = [out.rows(index[id(r)], r.num_computed_tokens)[1] - 1 for r in batch.requests]
    return torch.tensor(rows, dtype=torch.long, device=out.hidden.device)

