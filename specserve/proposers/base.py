"""The one interface every drafting method implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specserve.engine.request import Request
    from specserve.engine.runner import RunnerOutput


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]                  # <= the request's budget; may be empty
    probs: torch.Tensor | None = None     # [len(token_ids), vocab] draft probabilities, or None


@dataclass(slots=True)
class ProposeBatch:
    """Requests that decode next step, with how many drafts each may get."""

    requests: list[Request]
    max_num_tokens: list[int]             # per request: min(K, room left before its limits)
    # The target step that just ran (hidden states for head-based methods); its requests are a
    # superset of `requests`, found through `request_index`.
    runner_output: RunnerOutput | None
    request_index: list[int]              # position of each request in the step's batch
    num_emitted: list[int]                # tokens each request gained this step


class Proposer(Protocol):
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        """Draft up to `batch.max_num_tokens[i]` tokens for each request."""
        ...

    def finish(self, request: Request) -> None:
        """Forget per-request state (the request finished or was aborted)."""
        ...
