"""Prompt lookup first, a model-based drafter for the rest (`hybrid_prompt_lookup`).

Text that repeats earlier text (code being edited, quoted input) is drafted best by copying:
a request whose last N or more tokens occurred earlier in its prompt or output drafts the
tokens that followed the longest such match, as method 'ngram' does, at no model cost. Only
the other requests run the drafter. The drafter still sees every step, so a head keeps
ingesting the target's features of the requests it did not draft for, and a draft model
catches up on their tokens when it drafts for them again.
"""

from __future__ import annotations

import numpy as np

from specserve.methods.base import Proposal, ProposeBatch, Proposer, ProposerBase
from specserve.methods.ngram import find_ngram_draft


class HybridProposer(ProposerBase):
    # Longest match looked for: among matches of at least this many tokens, the earliest is
    # taken; growing them further costs a numpy pass per token and rarely changes the draft.
    MAX_MATCH = 16

    def __init__(self, drafter: Proposer, match: int) -> None:
        self.drafter = drafter
        self.match = match
        self.aux_hidden_layers = drafter.aux_hidden_layers
        self.caches = drafter.caches
        self.max_model_len = drafter.max_model_len
        self.modules = drafter.modules
        self.num_lookup_drafts = 0       # requests drafted by lookup (for benchmarks and tests)

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        out: list[Proposal | None] = [None] * len(batch.requests)
        rest = []
        for i, (r, k) in enumerate(zip(batch.requests, batch.max_num_tokens)):
            draft = find_ngram_draft(np.asarray(r.all_token_ids, dtype=np.int64), self.match,
                                     max(self.match, self.MAX_MATCH), k)
            if draft:
                out[i] = Proposal(draft)
            else:
                rest.append(i)
        self.num_lookup_drafts += len(batch.requests) - len(rest)
        sub = ProposeBatch([batch.requests[i] for i in rest],
                           [batch.max_num_tokens[i] for i in rest], batch.step_requests,
                           batch.runner_output)
        for i, p in zip(rest, self.drafter.propose(sub)):
            out[i] = p
        return out

    def finish(self, request) -> None:
        self.drafter.finish(request)

    @property
    def reuses_prefix(self) -> bool:
        return self.drafter.reuses_prefix

    def prefix_positions(self, request) -> int | None:
        return self.drafter.prefix_positions(request)

    def resume_prefix(self, request, num_positions: int) -> None:
        self.drafter.resume_prefix(request, num_positions)

    def reset(self) -> None:
        self.drafter.reset()

    def stats(self) -> dict[str, int]:
        return self.drafter.stats() | {"num_lookup_drafts": self.num_lookup_drafts}
