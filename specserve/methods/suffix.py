"""Suffix decoding (Oliaro et al. 2024; ArcticInference's path speculation).

Two sources: the request's own tokens (prompt + output) and a global tree over past responses
(FIFO-evicted beyond `suffix_decoding_max_cached_requests`). To draft, for each match length
m = 1, 2, ... while the last m tokens occur in the source, follow the most frequent continuation
while the running probability count(continuation)/count(match) stays >= `min_token_prob`, for
at most min(K, floor(m * max_spec_factor)) tokens. The draft with the highest score (sum of its
token probabilities; ties to the longer match) wins; the global tree's draft replaces the
request's own only when it scores strictly higher.

The request's own tokens are searched as an array (vectorised, no per-token tree building, so
a long prompt costs nothing up front); the global tree stores every substring of length
<= `max_tree_depth` of past responses with its count, so adding a token costs O(depth).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from specserve.config import SpeculativeConfig
from specserve.methods.base import DraftContext, MethodSpec, Proposal, ProposeBatch, ProposerBase


@dataclass(slots=True, eq=False)
class Node:
    count: int = 0
    children: dict[int, Node] = field(default_factory=dict)
    best: tuple[int, Node] | None = None        # most frequent child, kept up to date


class SuffixTree:
    """Counts of all substrings of length <= depth of the sequences added to it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()

    def cursor(self) -> list[Node]:
        """Nodes of the suffixes (lengths 0..depth-1) ending at the current end of a sequence."""
        return [self.root]

    def append(self, cursor: list[Node], token: int, delta: int = 1) -> list[Node]:
        """Add (delta=1) or remove (delta=-1) one token of a sequence; returns the new cursor."""
        nxt = [self.root]
        for node in cursor:
            child = node.children.get(token)
            if child is None:
                assert delta > 0, "removing a substring that was never added"
                child = node.children[token] = Node()
            child.count += delta
            if delta > 0:
                if node.best is None or child.count > node.best[1].count:
                    node.best = (token, child)
            else:
                if child.count == 0:
                    del node.children[token]
                if node.best is not None and node.best[1] is child:
                    node.best = max(node.children.items(), key=lambda kv: kv[1].count,
                                    default=None)
            if len(nxt) < self.depth:
                nxt.append(child)
        return nxt

    def add(self, tokens: list[int], delta: int = 1) -> None:
        cur = self.cursor()
        for t in tokens:
            cur = self.append(cur, t, delta)

    def speculate(self, context: list[int], max_tokens: int, spec_factor: float,
                  min_prob: float) -> tuple[list[int], float]:
        """Best draft continuing `context`; returns (tokens, score)."""
        best, best_score = [], 0.0
        n = len(context)
        for m in range(1, min(self.depth, n) + 1):
            node = self.root
            for t in context[n - m:]:
                node = node.children.get(t)
                if node is None:
                    return best, best_score       # longer matches cannot exist either
            limit = min(max_tokens, math.floor(m * spec_factor))
            draft, score, prob = [], 0.0, 1.0
            while len(draft) < limit and node.best is not None:
                tok, child = node.best
                prob *= child.count / node.count
                if prob < min_prob:
                    break
                draft.append(tok)
                score += prob
                node = child
            if draft and score >= best_score:
                best, best_score = draft, score
        return best, best_score


def _follow(tokens: np.ndarray, ends: np.ndarray, limit: int, min_prob: float
            ) -> tuple[list[int], float]:
    """Path speculation from the occurrences ending at `ends`: take the most frequent next token
    while the running probability stays >= min_prob."""
    draft, score, prob = [], 0.0, 1.0
    n = len(tokens)
    while len(draft) < limit and len(ends):
        nxt = ends + 1
        nxt = nxt[nxt < n]
        if not len(nxt):
            break
        vals = tokens[nxt]
        if len(vals) <= 64:                 # the usual case: counting in Python is cheaper
            seq = vals.tolist()
            counts: dict[int, int] = {}
            for t in seq:
                counts[t] = counts.get(t, 0) + 1
            tok = min(counts, key=lambda t: (-counts[t], t))
            count = counts[tok]
        else:
            bins = np.bincount(vals)
            tok = int(bins.argmax())        # ties: the smaller id, as above
            count = int(bins[tok])
        prob *= count / len(ends)
        if prob < min_prob:
            break
        draft.append(tok)
        score += prob
        ends = nxt[vals == tok]
    return draft, score


def speculate_in_sequence(tokens: np.ndarray, depth: int, max_tokens: int, spec_factor: float,
                          min_prob: float) -> tuple[list[int], float]:
    """The draft for `tokens` from its own earlier content; returns (tokens, score).

    `ends` holds the end positions of every occurrence of the current suffix (the trailing one
    included, as a tree built over the sequence would count it). Lengthening the match only
    filters `ends`, and a match length whose occurrence set equals the next one's gives the same
    draft with a smaller length cap, so only the longest length of each distinct set is scored.
    """
    n = len(tokens)
    best, best_score = [], 0.0
    ends = np.flatnonzero(tokens == tokens[-1])
    m = 1
    while True:
        longer = ends
        while m < min(depth, n):
            cand = ends[ends >= m]
            cand = cand[tokens[cand - m] == tokens[n - 1 - m]]
            if len(cand) != len(ends):
                longer = cand
                break
            m += 1
        draft, score = _follow(tokens, ends, min(max_tokens, math.floor(m * spec_factor)),
                               min_prob)
        if draft and score >= best_score:
            best, best_score = draft, score
        if longer is ends or len(longer) <= 1:      # no longer match with another occurrence
            return best, best_score
        ends, m = longer, m + 1


@dataclass
class _RequestState:
    global_cursor: list[Node]
    num_seen: int                 # tokens of the request already looked at
    response: list[int]           # output tokens (what the global tree keeps)


class SuffixProposer(ProposerBase):
    def __init__(self, config: SpeculativeConfig, ctx: DraftContext | None = None) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.global_tree = SuffixTree(self.depth)
        self.cached: OrderedDict[str, list[int]] = OrderedDict()   # finished responses, FIFO
        self.state: dict[str, _RequestState] = {}

    def _sync(self, req) -> _RequestState:
        """Add the request's new output tokens to the global tree."""
        st = self.state.get(req.request_id)
        if st is None:
            st = self.state[req.request_id] = _RequestState(
                self.global_tree.cursor(), req.num_prompt_tokens, [])
        for tok in req.all_token_ids[st.num_seen:]:
            st.response.append(tok)
            if self.max_cached:
                st.global_cursor = self.global_tree.append(st.global_cursor, tok)
        st.num_seen = req.num_tokens
        return st

    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        out = []
        for req, k in zip(batch.requests, batch.max_num_tokens):
            self._sync(req)
            context = req.all_token_ids[-self.depth:]
            draft, score = speculate_in_sequence(
                np.asarray(req.all_token_ids), self.depth, k, self.spec_factor, self.min_prob)
            if self.max_cached:
                g_draft, g_score = self.global_tree.speculate(
                    context, k, self.spec_factor, self.min_prob)
                if g_score > score:
                    draft = g_draft
            out.append(Proposal(draft))
        return out

    def reset(self) -> None:
        """Empty the global tree (a benchmark that repeats its prompts calls this per round, so
        that no round drafts from the previous round's answers to the same prompts)."""
        self.global_tree = SuffixTree(self.depth)
        self.cached.clear()

    def finish(self, request) -> None:
        """Keep the finished response in the global tree; evict the oldest past the limit."""
        if request.request_id not in self.state:
            return
        self._sync(request)
        st = self.state.pop(request.request_id)
        if not self.max_cached:
            return
        self.cached[request.request_id + f"#{id(st)}"] = st.response
        while len(self.cached) > self.max_cached:
            _, old = self.cached.popitem(last=False)
            self.global_tree.add(old, delta=-1)


def configure(config: SpeculativeConfig) -> None:
    """K defaults to the tree depth, as vLLM's."""
    if config.num_speculative_tokens is None:
        config.num_speculative_tokens = config.suffix_decoding_max_tree_depth


SPEC = MethodSpec(name="suffix", build=SuffixProposer, configure=configure,
                  keys=("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                        "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
                  summary="suffix decoding: suffix trees over the request and past responses")
