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
    # A draft tree: each token's parent (-1 = the last verified token), parents before children,
    # siblings with distinct tokens. None = a chain. Tree drafts are one-hot (no probs).
    parents: list[int] | None = None


@dataclass(slots=True)
class ProposeBatch:
    """Requests that decode next step, with how many drafts each may get, and the target step
    that just ran (all of its requests, including prompt chunks, for proposers that keep state
    built from the target's hidden states)."""

    requests: list["Request"]
    max_num_tokens: list[int]             # per request: min(K, room left before its limits)
    step_requests: list["Request"]        # every request of the step, in runner order
    runner_output: "RunnerOutput"


class Proposer(Protocol):
    # Target layers whose input hidden states the proposer needs (EAGLE-3); () for none.
    aux_hidden_layers: tuple[int, ...]

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        """Draft up to `batch.max_num_tokens[i]` tokens for each of `batch.requests` (which may
        be empty: the call still lets stateful proposers see the step)."""
        ...

    def finish(self, request: Request) -> None:
        """Forget per-request state (the request finished or was aborted)."""
        ...
