"""The verifier keeps the target distribution (statistical test with a bound a wrong verifier
fails), greedy rules, padding, and synthetic acceptance."""

from __future__ import annotations

import pytest
import torch

import specserve.sampling.rejection as rejection
from specserve.sampling.rejection import PLACEHOLDER_TOKEN_ID, VerifyRequest, verify
from specserve.sampling.sampler import process_logits
from specserve.sampling_params import SamplingParams

V = 6
N = 12000
TV_BOUND = 0.03     # sampling noise at N=12000, V=6 is ~0.01; a wrong verifier is off by > 0.1


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(3, V, generator=g) * 2          # rows: d1, d2, bonus
    draft_probs = torch.softmax(torch.randn(2, V, generator=g) * 2, dim=-1)
    return target_logits, draft_probs


def _first_token_hist(method: str, params: SamplingParams, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    target_logits, q = _setup(seed)
    p = process_logits(target_logits.clone(), [params] * 3)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = 500
    counts = torch.zeros(V)
    for _ in range(N // batch):
        reqs = []
        for _ in range(batch):
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            reqs.append(VerifyRequest(drafts, q, params, gen))
        out = verify(target_logits.repeat(batch, 1), reqs, method)
        counts += torch.bincount(out[:, 0], minlength=V).float()
    return counts / counts.sum(), p[0]


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["plain", "top_k", "top_p"])
def test_verifier_reproduces_target_distribution(method, params):
    hist, p = _first_token_hist(method, params)
    tv = 0.5 * (hist - p).abs().sum().item()
    assert tv < TV_BOUND, f"total variation {tv:.4f} from the target distribution"


def test_wrong_verifier_fails_the_bound(monkeypatch):
    """A verifier that resamples from p instead of the residual must fail the same test."""
    real = rejection._verify_random

    def wrong(p, r, method, rate):
        out = real(p, r, method, rate)
        if out[0] != r.draft_token_ids[0]:           # rejected at position 0: resample from p
            out = [rejection.sample_from(p[0], r.generator)]
        return out

    monkeypatch.setattr(rejection, "_verify_random", wrong)
    hist, p = _first_token_hist("probabilistic", SamplingParams(temperature=1.0))
    assert 0.5 * (hist - p).abs().sum().item() > TV_BOUND


def _greedy_req(drafts):
    return VerifyRequest(drafts, None, SamplingParams(temperature=0), torch.Generator())


def test_greedy_accepts_prefix_and_emits_argmax():
    logits = torch.full((4, V), -5.0)
    for row, tok in enumerate([2, 4, 1, 3]):
        logits[row, tok] = 5.0
    assert verify(logits, [_greedy_req([2, 4, 1])]).tolist() == [[2, 4, 1, 3]]   # all + bonus
    assert verify(logits, [_greedy_req([2, 5, 1])]).tolist() == [[2, 4, PLACEHOLDER_TOKEN_ID,
                                                                  PLACEHOLDER_TOKEN_ID]]
    assert verify(logits[:1], [_greedy_req([])]).tolist() == [[2]]


def test_mixed_batch_and_padding():
    logits = torch.full((5, V), -5.0)
    logits[[0, 1, 2, 3, 4], [2, 4, 0, 3, 5]] = 5.0
    rand = VerifyRequest([4], None, SamplingParams(temperature=1.0, top_k=1), torch.Generator())
    out = verify(logits, [_greedy_req([2]), rand, _greedy_req([])])
    # request 0: drafts [2] vs rows 0-1 -> 2 accepted + bonus 4; request 1 rows 2-3: top-k 1
    # makes p one-hot on 0, so draft 4 is rejected and 0 is recovered; request 2 row 4 -> 5.
    assert out.tolist() == [[2, 4], [0, PLACEHOLDER_TOKEN_ID], [5, PLACEHOLDER_TOKEN_ID]]


def test_synthetic_acceptance_rate():
    gen = torch.Generator().manual_seed(0)
    logits = torch.zeros(4 * 400, V)
    reqs = [VerifyRequest([1, 1, 1], None, SamplingParams(temperature=0), gen)
            for _ in range(400)]
    out = verify(logits, reqs, "synthetic", synthetic_acceptance_rate=0.6)
    accepted_first = (out[:, 0] == 1).float().mean().item()
    assert abs(accepted_first - 0.6) < 0.08
    assert (verify(logits[:4], reqs[:1], "synthetic", 1.0)[0, :3] == 1).all()


def test_synthetic_rates_per_position():
    """Conditional rates per position: [1, 1] accepts every draft (and the bonus), [0, 0] emits
    one token a step, [1, 0.5] accepts the first always and the second half the time."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.zeros(3 * 400, V)
    reqs = [VerifyRequest([1, 1], None, SamplingParams(temperature=0), gen) for _ in range(400)]
    assert (verify(logits, reqs, "synthetic", [1.0, 1.0]) != PLACEHOLDER_TOKEN_ID).all()
    out = verify(logits, reqs, "synthetic", [0.0, 0.0])
    assert (out[:, 1:] == PLACEHOLDER_TOKEN_ID).all()
    out = verify(logits, reqs, "synthetic", [1.0, 0.5])
    assert (out[:, 0] == 1).all() and abs((out[:, 1] == 1).float().mean().item() - 0.5) < 0.08


def _tree_hists(seed: int = 3, n: int = N):
    """Sampled verification of the tree root -> a, b; a -> c with fixed drafts: histograms of
    the first token, and of the second after a and after b, with the target rows they follow."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, V, generator=g) * 1.5       # rows: root, after a, after c, after b
    params = SamplingParams(temperature=1.0)
    p = process_logits(logits.clone(), [params] * 4)
    top0 = p[0].argsort(descending=True).tolist()
    a, b, c = top0[0], top0[1], int(p[1].argmax())
    parents, drafts = [-1, 0, -1], [a, c, b]            # depth-first: a, c (under a), b
    rows = logits[[0, 1, 2, 3]]
    gen = torch.Generator().manual_seed(seed + 1)
    first, after_a, after_b = torch.zeros(V), torch.zeros(V), torch.zeros(V)
    batch = 500
    for _ in range(n // batch):
        reqs = [VerifyRequest(drafts, None, params, gen, parents) for _ in range(batch)]
        out = verify(rows.repeat(batch, 1), reqs)
        first += torch.bincount(out[:, 0], minlength=V).float()
        for row in out.tolist():
            if row[0] == a:
                after_a[row[1]] += 1
            elif row[0] == b:
                after_b[row[1]] += 1
    norm = lambda h: h / h.sum()                         # noqa: E731
    return (norm(first), p[0]), (norm(after_a), p[1]), (norm(after_b), p[3])


def test_tree_verifier_reproduces_target_distribution():
    """Under sampling, a tree's children are tried in turn against the residual: the first
    token, and the token after each accepted child, follow the target's rows."""
    for hist, p in _tree_hists():
        tv = 0.5 * (hist - p).abs().sum().item()
        assert tv < 0.04, f"total variation {tv:.4f} from the target distribution"


def test_wrong_tree_verifier_fails_the_bound(monkeypatch):
    """Trying the second child against the full distribution instead of the residual (the
    first child's token not removed) must fail the same test."""
    real_rand = torch.rand

    def residual_kept(p, r):
        g, emitted, node = r.generator, [], -1
        while True:
            dist = p[node + 1].double()
            for child in (c for c, q in enumerate(r.parents) if q == node):
                tok = r.draft_token_ids[child]
                if real_rand((), dtype=torch.float64, generator=g) < dist[tok] / dist.sum():
                    emitted.append(tok)
                    node = child
                    break
            else:
                return emitted + [rejection.sample_from(dist, g)]

    monkeypatch.setattr(rejection, "_verify_random_tree", residual_kept)
    first = _tree_hists()[0]
    assert 0.5 * (first[0] - first[1]).abs().sum().item() > 0.04


def test_coupled_verification_emits_the_seeded_draws_whatever_the_drafts():
    """A seeded request's tokens are its draws at each output position: drafts only decide how
    many of them one step emits (all leading matches plus one), in a chain and in a tree."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(1, V, generator=g) * 2).repeat(4, 1)  # the same row after any prefix
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=-5)

    def run(drafts, position, parents=None):
        rows = logits[:len(drafts) + 1]
        req = VerifyRequest(drafts, None, params, torch.Generator(), parents, position)
        return [t for t in verify(rows.clone(), [req])[0].tolist() if t != PLACEHOLDER_TOKEN_ID]

    draws = [run([], n)[0] for n in range(10, 14)]              # no drafts: plain sampling
    assert run(draws[:3], 10) == draws                          # every draft matches
    wrong = (draws[1] + 1) % V
    assert run([draws[0], wrong, draws[2]], 10) == draws[:2]
    # a tree: node 0 (wrong) and node 1 (right) after the root, node 2 below node 1
    assert run([wrong if draws[0] != wrong else (wrong + 1) % V, draws[0], draws[1]], 10,
               [-1, -1, 1]) == draws[:3]
    # the uniforms are fixed by (seed, position) and spread over [0, 1)
    u = [rejection.coupled_uniform(7, n) for n in range(4000)]
    assert u == [rejection.coupled_uniform(7, n) for n in range(4000)]
    assert u != [rejection.coupled_uniform(8, n) for n in range(4000)]
    assert torch.histc(torch.tensor(u), 10, 0, 1).min() > 330
