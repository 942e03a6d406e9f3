"""What the one-pass drafters share (PARD's draft model, P-EAGLE's head, DFlash's block): the
mask token that stands for the tokens not known yet, the training layout of mask copies, and
turning the K logit rows of one pass into drafts."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from specserve.methods.base import DraftRequest, Proposal
from specserve.sampling.sampler import greedy_ids, sample_from

# where a parallel drafter's config.json names its mask token, in vLLM's order of lookup
MASK_TOKEN_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "pard_token", "ptd_token_id")
NUM_SPECIAL_TOKENS = 3      # <|endoftext|>, <|im_start|>, <|im_end|>: never a mask


def mask_token_id(draft_cfg: dict, path: str, train_hint: str) -> int:
    """The mask token a parallel drafter was trained with (ValueError when it names none;
    `train_hint` says how to train one)."""
    for key in MASK_TOKEN_KEYS:
        cfg, name = draft_cfg, key
        if "." in key:
            outer, name = key.split(".")
            cfg = draft_cfg.get(outer) or {}
        if isinstance(cfg.get(name), int):
            return cfg[name]
    raise ValueError(f"{path}: parallel drafting needs a drafter trained for it, and its "
                     f"config.json names no mask token ({', '.join(MASK_TOKEN_KEYS)}); "
                     f"{train_hint}")


def unused_token(train_ids: np.ndarray, vocab_size: int) -> int:
    """The lowest non-special id that never occurs in the training tokens (a mask token)."""
    return first_unused(np.bincount(train_ids, minlength=vocab_size))


def first_unused(counts: np.ndarray) -> int:
    """The lowest non-special id whose count [V] is 0."""
    free = np.nonzero(counts[NUM_SPECIAL_TOKENS:] == 0)[0]
    if not len(free):
        raise ValueError("every token id occurs in the training text: no id is free for a "
                         "mask token")
    return int(free[0]) + NUM_SPECIAL_TOKENS


def depth_weights(n: int, gamma: float | None, device: torch.device | None = None
                  ) -> torch.Tensor:
    """Training weights of drafts 1..n of a parallel pass: exp(-(d-1) / gamma), so that the
    early drafts, which every later one needs, count most; gamma None: all alike. [n]"""
    d = torch.arange(n, device=device, dtype=torch.float32)
    return torch.ones_like(d) if gamma is None else torch.exp(-d / gamma)


def pard_mask(length: int, k: int, device: torch.device | None = None) -> torch.Tensor:
    """The training layout of a parallel drafter (PARD, P-EAGLE): [k * length, k * length]
    bool, True = may attend, for a sequence of `length` real rows followed by k-1 mask copies
    (row c * length + j = copy c at position j). Copy c at position j sees what the mask c
    rows after real row j - c sees at inference: real rows 0..j-c and one row of each earlier
    copy."""
    j = torch.arange(length, device=device)
    blocks = [[torch.zeros(length, length, dtype=torch.bool, device=device)] * k
              for _ in range(k)]
    for c in range(k):
        blocks[c][0] = j[None, :] <= (j[:, None] - c)                    # real tokens 0..j-c
        for m in range(1, c + 1):                                        # copy m at j-c+m
            blocks[c][m] = j[None, :] == (j[:, None] - c + m)
    return torch.cat([torch.cat(row, 1) for row in blocks], 0)


def pick_tokens(logits: torch.Tensor, reqs: list[DraftRequest], sample: bool
                ) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft per row of logits [N, V] (row i for reqs[i]): the argmax, or with `sample` a
    draw at the request's temperature (argmax for greedy requests) with its probabilities."""
    if not sample:
        return greedy_ids(logits), [None] * len(reqs)
    toks, probs = [], []
    for row, r in zip(logits, reqs):
        if r.params.is_greedy:
            toks.append(int(row.argmax()))
            probs.append(torch.nn.functional.one_hot(row.argmax(), row.numel()).float())
        else:
            p = (row / r.params.temperature).softmax(-1)
            toks.append(sample_from(p, r.generator))
            probs.append(p)
    return toks, probs


def confident(logits: torch.Tensor, toks: list[int], threshold: float) -> list[bool]:
    """Whether the drafter gave each chosen token (logits [N, V]) at least `threshold`."""
    chosen = logits.gather(-1, torch.tensor(toks, device=logits.device)[:, None]).squeeze(-1)
    return ((chosen - logits.logsumexp(-1)).exp() >= threshold).tolist()


def drafts_from_rows(logits: torch.Tensor, budgets: list[int], reqs: list[DraftRequest],
                     sample: bool, threshold: float) -> list[Proposal]:
    """Proposals from one pass's logits [sum(budgets), V]: row j of request i's `budgets[i]`
    rows gives its draft j. Each request keeps its drafts up to and including the first the
    drafter was not sure of (with a threshold)."""
    rows = list(itertools.accumulate(budgets, initial=0))
    if not sample:                       # every row's argmax (and confidence) at once
        toks = greedy_ids(logits)
        sure = confident(logits, toks, threshold) if threshold else [True] * len(toks)
        out = []
        for lo, hi in zip(rows, rows[1:]):
            n = next((j + 1 for j, ok in enumerate(sure[lo:hi]) if not ok), hi - lo)
            out.append(Proposal(toks[lo:lo + n]))
        return out
    drafts: list[list[int]] = [[] for _ in reqs]
    probs: list[list[torch.Tensor]] = [[] for _ in reqs]
    active = list(range(len(reqs)))
    for j in range(max(budgets, default=0)):   # draft j of every request that drafts that far
        active = [i for i in active if j < budgets[i]]
        if not active:
            break
        step = logits[torch.tensor([rows[i] + j for i in active], device=logits.device)]
        toks, ps = pick_tokens(step, [reqs[i] for i in active], sample)
        sure = confident(step, toks, threshold) if threshold else [True] * len(active)
        for i, t, p in zip(active, toks, ps):
            drafts[i].append(t)
            probs[i].append(p)
        active = [i for i, ok in zip(active, sure) if ok]
    return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]
