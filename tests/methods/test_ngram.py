"""Prompt-lookup cases (vLLM's test ideas)."""

import numpy as np
import pytest

from specserve.methods.ngram import find_ngram_draft


@pytest.mark.parametrize("tokens, lo, hi, k, draft", [
    # no match at all
    ([1, 2, 3, 4, 5], 2, 3, 4, []),
    # the longest n wins: the 3-gram [2,3,4] matches at 1 -> [9]; 2-gram [3,4] would give [5]
    ([3, 4, 5, 2, 3, 4, 9, 7, 2, 3, 4], 2, 3, 2, [9, 7]),
    # several equal matches: the earliest occurrence is used
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
    # fewer tokens than K follow the match
    ([7, 8, 9, 7, 8], 2, 2, 5, [9, 7, 8]),
    # sequence shorter than min n
    ([4], 1, 2, 3, []),
    # only lengths in [min, max] count: the 1-gram match is ignored when min is 2
    ([5, 6, 7, 5], 2, 3, 3, []),
    ([5, 6, 7, 5], 1, 3, 3, [6, 7, 5]),
    # overlapping repeats
    ([1, 1, 1, 1], 2, 2, 5, [1, 1]),
])
def test_ngram_cases(tokens, lo, hi, k, draft):
    assert find_ngram_draft(np.array(tokens), lo, hi, k) == draft


def test_ngram_draft_equals_a_window_by_window_search():
    """The longest n in [lo, hi] whose trailing n-gram occurs earlier, earliest occurrence, as
    a plain scan over every window finds it, on random short-alphabet sequences."""
    def scan(tokens, lo, hi, k):
        L = len(tokens)
        for n in range(min(hi, L - 1), lo - 1, -1):
            for s in range(L - n):
                if tokens[s:s + n] == tokens[L - n:]:
                    return tokens[s + n:s + n + k]
        return []
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, 3, int(rng.integers(1, 40))).tolist()
        lo = int(rng.integers(1, 5))
        hi = lo + int(rng.integers(0, 6))
        assert find_ngram_draft(np.array(tokens), lo, hi, 4) == scan(tokens, lo, hi, 4)
