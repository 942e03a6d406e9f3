"""Verification of draft tokens: the output keeps exactly the target's distribution.

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). Terms:
- accepted tokens: drafts d_i that pass the test;
- recovered token: at the first rejection, a token drawn from norm(max(p_i - q_i, 0));
- bonus token: drawn from row k of the target when all k drafts were accepted.
Output tokens = accepted + recovered or bonus, so 1..k+1 tokens per request per step.

Greedy (temperature 0): d_i is accepted iff it equals argmax p_i; the first mismatch emits
argmax p_i. Random: accept d_i iff u < p_i(d_i) / q_i(d_i) with u ~ U[0, 1) in float64 from the
request's generator; q_i is one-hot on d_i when the proposer gives no probabilities. Target rows
are processed with the request's temperature/top-k/top-p/min-p before the test. A request with
k = 0 drafts gets ordinary sampling from its single row, so one path serves every request.

A draft tree keeps, greedily, the path of nodes that each equal the target's argmax after their
parent, then emits the argmax after the path's last node; under sampling it tries a node's
children one after another against the residual distribution (`_verify_random_tree`).

Seeded random requests are verified by coupling instead, so that their output does not depend on
speculation: the token at output position n is the inverse-CDF draw from the processed target
row with u_n, a uniform fixed by (seed, n) alone (`coupled_uniform`), and a draft is accepted iff
it equals that draw - the greedy rule with the draw in place of the argmax. Without drafts this
is ordinary sampling, so every output token has the target's distribution and the same seed gives
the same tokens with any drafter, K or tree; a one-hot draft d passes with probability p(d), as
under the strict test, but drafts' own probabilities are not used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from specserve.sampling.sampler import greedy_ids, process_logits, sample_from
from specserve.sampling_params import SamplingParams
from specserve.token_tree import node_depths

PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class VerifyRequest:
    """One request's share of a verify step."""

    draft_token_ids: list[int]              # k drafts (k >= 0); logits rows = k + 1
    draft_probs: torch.Tensor | None        # [k, V] proposer probabilities, None = one-hot drafts
    params: SamplingParams
    generator: torch.Generator
    parents: list[int] | None = None        # a draft tree (one-hot drafts), None = a chain
    position: int = 0                       # output index of the token row 0 gives (coupling)


def verify(logits: torch.Tensor, reqs: list[VerifyRequest], method: str = "strict",
           synthetic_acceptance_rate: float | list[float] | None = None,
           errors: dict[int, Exception] | None = None) -> torch.Tensor:
    """Verify every request's drafts against its k+1 target rows.

    logits: [sum(k_i + 1), V] float32 target logits, request-major.
    method: "strict" (drafts one-hot, the default), "probabilistic" (uses draft_probs in the
    ratio test) or "synthetic" (acceptance drawn at `synthetic_acceptance_rate`: one rate, or
    the conditional rate of each position; independent of the target; for benchmarking only -
    the output is then not the target's distribution).
    errors: when given, an exception raised by one request's verification is stored here under
    its index and its row is all placeholders, so that one request cannot fail the others.
    Returns [batch, max_k + 1] int64, padded with PLACEHOLDER_TOKEN_ID.
    """
    max_k = max(len(r.draft_token_ids) for r in reqs)
    out: list[list[int]] = []
    offsets, o = [], 0
    for r in reqs:
        offsets.append(o)
        o += len(r.draft_token_ids) + 1
    assert o == logits.shape[0], "one logits row per draft plus one bonus row per request"

    # one sync for all rows
    argmax = greedy_ids(logits) if any(r.params.is_greedy for r in reqs) else []
    random_ids = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
    probs_of: dict[int, torch.Tensor] = {}
    if random_ids:
        rows = torch.cat([torch.arange(offsets[i], offsets[i] + len(reqs[i].draft_token_ids) + 1)
                          for i in random_ids])
        row_params = [reqs[i].params for i in random_ids
                      for _ in range(len(reqs[i].draft_token_ids) + 1)]
        probs = process_logits(logits[rows], row_params)                   # [n_rows, V]
        p0 = 0
        for i in random_ids:
            n = len(reqs[i].draft_token_ids) + 1
            probs_of[i] = probs[p0:p0 + n]
            p0 += n

    for i, r in enumerate(reqs):
        try:
            emitted = _verify_one(i, r, offsets[i], argmax, probs_of, method,
                                  synthetic_acceptance_rate)
        except Exception as e:
            if errors is None:
                raise
            errors[i], emitted = e, []
        out.append(emitted + [PLACEHOLDER_TOKEN_ID] * (max_k + 1 - len(emitted)))
    return torch.tensor(out, dtype=torch.long)


def _verify_one(i: int, r: VerifyRequest, offset: int, argmax: list[int],
                probs_of: dict[int, torch.Tensor], method: str,
                rate: float | list[float] | None) -> list[int]:
    """Tokens request i emits: argmax holds every row's greedy token, probs_of its processed
    target rows when it samples."""
    k = len(r.draft_token_ids)
    if r.params.seed is not None and not r.params.is_greedy and method != "synthetic":
        draws = _coupled_draws(probs_of[i], r)
        return (_verify_greedy_tree(draws, r) if r.parents is not None
                else _verify_greedy(draws, r, "strict", None))
    if r.parents is not None:
        assert method != "synthetic", "synthetic acceptance is defined for chains only"
        return (_verify_greedy_tree(argmax[offset:offset + k + 1], r)
                if r.params.is_greedy else _verify_random_tree(probs_of[i], r))
    if r.params.is_greedy:
        return _verify_greedy(argmax[offset:offset + k + 1], r, method, rate)
    return _verify_random(probs_of[i], r, method, rate)


def coupled_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) fixed by (seed, output position) alone: a hash, not a stream, so
    that it does not depend on how many draws speculation made before."""
    key = (seed % 2**64).to_bytes(8, "little") + position.to_bytes(8, "little")
    h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return (h >> 11) * 2.0 ** -53


def _coupled_draws(p: torch.Tensor, r: VerifyRequest) -> list[int]:
    """The target's seeded draw of each row of p [k + 1, V]: inverse CDF at the uniform of the
    row's output position (row i + 1 of a tree sits at the depth of node i)."""
    depths = node_depths(r.parents) if r.parents is not None else range(1, len(p))
    pos = [r.position] + [r.position + d for d in depths]
    u = torch.tensor([coupled_uniform(r.params.seed, n) for n in pos], dtype=torch.float64,
                     device=p.device)
    cdf = p.double().cumsum(-1)                                                # [k + 1, V]
    ids = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)       # [k + 1, 1]
    return ids.squeeze(-1).clamp_max(p.shape[-1] - 1).tolist()


def _uniforms(r: VerifyRequest) -> torch.Tensor:
    """One float64 uniform per draft from the request's generator (float32 can give exact 0)."""
    g = r.generator
    return torch.rand(len(r.draft_token_ids), dtype=torch.float64, generator=g, device=g.device)


def _synthetic_accepts(r: VerifyRequest, rate: float | list[float]) -> list[bool]:
    """Draft j accepted iff u_j < rate (or rate[j]: the conditional rate of position j)."""
    u = _uniforms(r)
    if isinstance(rate, list):
        rate = torch.tensor(rate[:len(u)], dtype=torch.float64, device=u.device)
    return (u < rate).tolist()


def _verify_greedy(argmax: list[int], r: VerifyRequest, method: str, rate: float | None
                   ) -> list[int]:
    k = len(r.draft_token_ids)
    accepts = (_synthetic_accepts(r, rate) if method == "synthetic"
               else [argmax[j] == r.draft_token_ids[j] for j in range(k)])
    for j in range(k):
        if not accepts[j]:
            return r.draft_token_ids[:j] + [argmax[j]]
    return r.draft_token_ids + [argmax[k]]


def _verify_greedy_tree(argmax: list[int], r: VerifyRequest) -> list[int]:
    # argmax[0]: the target's token after the last verified one; argmax[i + 1]: after node i.
    # Follow the child that carries the target's token; emit the target's token where none does.
    emitted, row = [], 0
    while True:
        tok = argmax[row]
        emitted.append(tok)
        child = next((i for i, (p, d) in enumerate(zip(r.parents, r.draft_token_ids))
                      if p == row - 1 and d == tok), None)
        if child is None:
            return emitted
        row = child + 1


def _verify_random_tree(p: torch.Tensor, r: VerifyRequest) -> list[int]:
    # p: [k + 1, V] processed target probabilities; row 0 after the last verified token, row
    # i + 1 after node i. A node's children are tried in turn as one-hot drafts against what is
    # left of the target's distribution: child c passes with probability residual(d_c) /
    # sum(residual), else d_c leaves the residual. Each test is the strict test of a one-hot
    # draft against the (renormalised) residual, so whichever token comes out - a child's, or a
    # draw from the final residual - has the target's distribution (SpecInfer's multi-draft rule
    # for deterministic drafts). Then the same happens below the accepted child.
    g = r.generator
    emitted, node = [], -1
    while True:
        residual = p[node + 1].double().clone()
        for child in (c for c, q in enumerate(r.parents) if q == node):
            tok = r.draft_token_ids[child]
            u = torch.rand((), dtype=torch.float64, generator=g, device=g.device)
            if u * residual.sum() < residual[tok]:
                emitted.append(tok)
                node = child
                break
            residual[tok] = 0
        else:
            return emitted + [sample_from(residual, g)]


def _verify_random(p: torch.Tensor, r: VerifyRequest, method: str, rate: float | None
                   ) -> list[int]:
    # p: [k + 1, V] processed target probabilities
    k = len(r.draft_token_ids)
    q = r.draft_probs if method == "probabilistic" else None
    if k:
        if method == "synthetic":
            accepts = _synthetic_accepts(r, rate)
        else:
            rows = torch.arange(k, device=p.device)
            d = torch.tensor(r.draft_token_ids, device=p.device)
            p_d = p[rows, d].double()                                      # [k]
            q_d = (q[rows, d].double() if q is not None
                   else torch.ones(k, dtype=torch.float64, device=p.device))
            u = _uniforms(r).to(p.device)
            # q_d == 0 cannot happen for a sampled draft; guard it as a rejection.
            accepts = ((q_d > 0) & (u * q_d < p_d)).tolist()
        for j in range(k):
            if not accepts[j]:
                if q is not None:
                    residual = (p[j] - q[j]).clamp_min(0)
                else:
                    residual = p[j].clone()
                    residual[r.draft_token_ids[j]] = 0
                if residual.sum() <= 0:        # p == q: any draw from p is exact
                    residual = p[j]
                return r.draft_token_ids[:j] + [sample_from(residual, r.generator)]
    return r.draft_token_ids + [sample_from(p[k], r.generator)]
