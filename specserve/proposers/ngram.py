"""Prompt lookup (n-gram) drafting.

Find the longest n in [prompt_lookup_min, prompt_lookup_max] whose trailing n-gram occurred
earlier in the request's tokens (prompt + output); among equal n the earliest occurrence wins.
Propose the up to K tokens that followed it; no match gives an empty draft.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specserve.config import SpeculativeConfig
from specserve.proposers.base import Proposal, ProposeBatch


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [L] int. Returns the draft (possibly shorter than k, or empty)."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # Windows starting at 0..L-n-1: each leaves at least one token after it and excludes
        # the trailing n-gram itself.
        windows = sliding_window_view(tokens[:L - 1], n)             # [L - n, n]
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, engine=None) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    aux_hidden_layers = ()

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        return [Proposal(find_ngram_draft(np.asarray(r.all_token_ids, dtype=np.int64),
                                          self.min_n, self.max_n, k))
                for r, k in zip(batch.requests, batch.max_num_tokens)]

    def finish(self, request) -> None:
        pass
