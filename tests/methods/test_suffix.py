"""Suffix tree counts, path speculation, scoring, global tree and FIFO eviction."""

from types import SimpleNamespace

from specserve.config import SpeculativeConfig
from specserve.methods.base import ProposeBatch
from specserve.methods.suffix import SuffixProposer, SuffixTree


def test_counts_of_substrings():
    t = SuffixTree(depth=3)
    t.add([1, 2, 1, 2, 3])
    assert t.root.children[1].count == 2
    assert t.root.children[1].children[2].count == 2
    assert t.root.children[1].children[2].children[3].count == 1
    assert 3 not in t.root.children[1].children[2].children[3].children   # depth 3 cap
    t.add([1, 2, 3], delta=-1)
    assert t.root.children[1].count == 1 and 3 not in t.root.children[1].children[2].children


def test_speculate_follows_most_frequent_child():
    t = SuffixTree(depth=8)
    t.add([5, 1, 2, 5, 1, 2, 5, 1, 3])
    # context ends in [5, 1]; after "5 1": "2" twice, "3" once -> 2/3 >= 0.1
    draft, score = t.speculate([9, 5, 1], max_tokens=3, spec_factor=2.0, min_prob=0.1)
    assert draft[0] == 2 and score > 0


def test_min_token_prob_stops_the_path():
    t = SuffixTree(depth=8)
    t.add([1, 2, 1, 3, 1, 4, 1, 5])
    draft, _ = t.speculate([1], max_tokens=4, spec_factor=4.0, min_prob=0.3)
    assert draft == []          # every continuation of "1" has probability 1/4 < 0.3
    draft, _ = t.speculate([1], max_tokens=4, spec_factor=4.0, min_prob=0.2)
    assert len(draft) >= 1


def test_spec_factor_caps_length():
    t = SuffixTree(depth=16)
    t.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 1])
    # match "1" (m=1) and factor 2 -> at most 2 tokens from the 1-token match
    draft, _ = t.speculate([1], max_tokens=8, spec_factor=2.0, min_prob=0.0)
    assert draft == [2, 3]


def _req(rid, prompt, output=()):
    toks = list(prompt) + list(output)
    return SimpleNamespace(request_id=rid, all_token_ids=toks, num_tokens=len(toks),
                           num_prompt_tokens=len(prompt))


def _batch(reqs, k=4):
    return ProposeBatch(reqs, [k] * len(reqs), reqs, None)


def test_global_tree_drafts_from_past_responses_and_evicts_fifo():
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                            suffix_decoding_max_cached_requests=1,
                            suffix_decoding_max_spec_factor=2.0)
    p = SuffixProposer(cfg)
    first = _req("a", [50, 51], [10, 11, 12, 13, 14])
    p.propose(_batch([first]))
    p.finish(first)
    # a new request whose prompt ends like the past response continues it from the global tree
    second = _req("b", [60, 10, 11])
    assert p.propose(_batch([second]))[0].token_ids == [12, 13, 14]
    p.finish(second)
    third = _req("c", [70], [20, 21])
    p.propose(_batch([third]))
    p.finish(third)              # evicts "a" (limit 1 cached response) ... and then "b"
    assert p.propose(_batch([_req("d", [60, 10, 11])]))[0].token_ids == []


def test_reset_empties_the_global_tree():
    p = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                                         suffix_decoding_max_spec_factor=2.0))
    first = _req("a", [50, 51], [10, 11, 12, 13, 14])
    p.propose(_batch([first]))
    p.finish(first)
    assert p.propose(_batch([_req("b", [60, 10, 11])]))[0].token_ids == [12, 13, 14]
    p.reset()
    assert p.propose(_batch([_req("c", [60, 10, 11])]))[0].token_ids == []
    again = _req("d", [50, 51], [10, 11, 12, 13, 14])     # and it learns afresh
    p.propose(_batch([again]))
    p.finish(again)
    assert p.propose(_batch([_req("e", [60, 10, 11])]))[0].token_ids == [12, 13, 14]


def test_local_tree_uses_the_prompt():
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=3,
                            suffix_decoding_max_cached_requests=0)
    p = SuffixProposer(cfg)
    r = _req("x", [1, 2, 3, 4, 5, 9, 9, 1, 2])
    assert p.propose(_batch([r], k=3))[0].token_ids == [3, 4]    # factor 1: match "1 2" -> 2


def _brute_force(tokens, depth, max_tokens, factor, min_prob):
    """The definition, spelled out: every match length, most frequent continuation (ties to the
    smaller token id), best score wins with ties to the longer match."""
    import math
    n = len(tokens)
    best, best_score = [], 0.0
    for m in range(1, min(depth, n) + 1):
        pat = tokens[n - m:]
        ends = [e for e in range(m - 1, n) if tokens[e - m + 1:e + 1] == pat]
        if m > 1 and len(ends) <= 1:
            break
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < min(max_tokens, math.floor(m * factor)):
            nxt = [e + 1 for e in ends if e + 1 < n]
            if not nxt:
                break
            counts = {}
            for e in nxt:
                counts[tokens[e]] = counts.get(tokens[e], 0) + 1
            tok = min(counts, key=lambda t: (-counts[t], t))
            prob *= counts[tok] / len(ends)
            if prob < min_prob:
                break
            draft.append(tok)
            score += prob
            ends = [e for e in nxt if tokens[e] == tok]
        if draft and score >= best_score:
            best, best_score = draft, score
    return best, best_score


def test_sequence_search_matches_the_definition():
    import numpy as np

    from specserve.methods.suffix import speculate_in_sequence
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=n).tolist()
        depth = int(rng.integers(1, 30))
        k, factor, min_prob = int(rng.integers(1, 8)), float(rng.choice([0.5, 1.0, 2.0])), \
            float(rng.choice([0.0, 0.1, 0.3]))
        got = speculate_in_sequence(np.array(tokens), depth, k, factor, min_prob)
        want = _brute_force(tokens, depth, k, factor, min_prob)
        assert got[0] == want[0] and abs(got[1] - want[1]) < 1e-9, (trial, tokens, depth)
