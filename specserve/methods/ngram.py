"""Prompt lookup (n-gram) drafting.

Find the longest n in [prompt_lookup_min, prompt_lookup_max] whose trailing n-gram occurred
earlier in the request's tokens (prompt + output); among equal n the earliest occurrence wins.
Propose the up to K tokens that followed it; no match gives an empty draft.
"""

from __future__ import annotations

import numpy as np

from specserve.config import SpeculativeConfig
from specserve.methods.base import DraftContext, MethodSpec, Proposal, ProposeBatch, ProposerBase


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [L] int. Returns the draft (possibly shorter than k, or empty)."""
    L = len(tokens)
    # Earlier positions holding the last token, each the end of a match of length n so far;
    # grow n while some still match, keeping those that do (in order: the earliest first).
    # Each ends at L - 2 at most, so a token follows it and it is not the trailing n-gram.
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    n = 1 if ends.size else 0
    while n < max_n:
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[L - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if n < min_n:
        return []
    start = int(ends[0]) + 1
    return tokens[start:start + k].tolist()


class NgramProposer(ProposerBase):
    def __init__(self, config: SpeculativeConfig, ctx: DraftContext | None = None) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        return [Proposal(find_ngram_draft(np.asarray(r.all_token_ids, dtype=np.int64),
                                          self.min_n, self.max_n, k))
                for r, k in zip(batch.requests, batch.max_num_tokens)]


def configure(config: SpeculativeConfig) -> None:
    """prompt_lookup_min/max: 5/5 when both are unset; one given mirrors the other."""
    lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo < 1 or hi < 1:
        raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be >= 1, got {lo} and "
                         f"{hi}")
    if lo > hi:
        raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    config.prompt_lookup_min, config.prompt_lookup_max = lo, hi


SPEC = MethodSpec(name="ngram", build=NgramProposer, configure=configure,
                  suggested={"prompt_lookup_min": 2, "prompt_lookup_max": 5},
                  keys=("prompt_lookup_min", "prompt_lookup_max"),
                  summary="prompt lookup: copy what followed the last n-gram's earlier match")
