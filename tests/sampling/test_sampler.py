"""Sampling filters keep exactly the right support."""

import torch

from specserve.sampling.sampler import process_logits
from specserve.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))


def support(**kw) -> set[int]:
    probs = process_logits(LOGITS.clone(), [SamplingParams(temperature=1.0, **kw)])
    assert torch.allclose(probs.sum(-1), torch.ones(1))
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


def test_top_k_support():
    assert support(top_k=1) == {1}
    assert support(top_k=3) == {1, 3, 4}
    assert support(top_k=-1) == {0, 1, 2, 3, 4}


def test_top_p_support():
    # sorted: 0.4 (1), 0.3 (3), 0.15 (4), 0.1 (2), 0.05 (0)
    assert support(top_p=0.4) == {1}
    assert support(top_p=0.41) == {1, 3}
    assert support(top_p=0.7) == {1, 3}
    assert support(top_p=0.85) == {1, 3, 4}
    assert support(top_p=1.0) == {0, 1, 2, 3, 4}


def test_top_k_then_top_p():
    # After top-k=3 the kept probs renormalise to 0.47, 0.35, 0.18.
    assert support(top_k=3, top_p=0.5) == {1, 3}


def test_min_p_support():
    assert support(min_p=0.5) == {1, 3}           # >= 0.5 * 0.4
    assert support(min_p=0.3) == {1, 3, 4}


def test_kept_probabilities_are_renormalised_target():
    probs = process_logits(LOGITS.clone(), [SamplingParams(temperature=1.0, top_k=2)])
    assert torch.allclose(probs[0, [1, 3]], torch.tensor([0.4, 0.3]) / 0.7)


def test_temperature_sharpens():
    cold = process_logits(LOGITS.clone(), [SamplingParams(temperature=0.5)])
    assert cold[0, 1] > 0.4 and torch.allclose(cold.sum(), torch.tensor(1.0))


def test_rows_use_their_own_params():
    probs = process_logits(LOGITS.repeat(2, 1), [SamplingParams(temperature=1.0, top_k=1),
                                                 SamplingParams(temperature=1.0)])
    assert (probs[0] > 0).sum() == 1 and (probs[1] > 0).sum() == 5


def test_greedy_ids_take_the_first_of_equal_maxima_like_torch():
    from specserve.sampling.sampler import greedy_ids
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    x[1, 7] = x[1, 30] = x[1].max() + 1                      # a tie: the first one wins
    x[2, 4] = float("nan")                                   # NaN counts as the maximum
    for t in (x, x.to(torch.bfloat16), x[:, ::2]):           # NumPy path, torch path, strided
        assert greedy_ids(t) == t.argmax(dim=-1).tolist()
    assert greedy_ids(x)[1] == 7 and greedy_ids(x)[2] == 4


def test_degenerate_rows_fall_back_to_their_argmax():
    """A row that is no distribution after filtering (a NaN or inf logit) samples its argmax
    while the other rows keep their distribution: one row cannot fail the batch."""
    from specserve.sampling.sampler import sample_from
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5],
                           [0.0, float("nan"), 3.0, 1.0],
                           [float("-inf"), float("inf"), 0.0, 0.0],
                           [float("nan")] * 4])
    probs = process_logits(logits, [SamplingParams(temperature=1.0)] * 4)
    assert torch.allclose(probs[0], logits[0].softmax(-1))
    assert probs[1].tolist() == [0, 0, 1, 0]
    assert probs[2].tolist() == [0, 1, 0, 0]
    assert probs[3].sum() == 1 and probs[3].isfinite().all()
    g = torch.Generator().manual_seed(0)
    assert [sample_from(p, g) for p in probs[1:3]] == [2, 1]


def test_sample_from_a_vector_with_no_mass_gives_its_argmax():
    from specserve.sampling.sampler import sample_from
    g = torch.Generator().manual_seed(0)
    assert sample_from(torch.zeros(4), g) == 0
    assert sample_from(torch.tensor([0.1, float("nan"), 0.7, 0.2]), g) == 2
    assert sample_from(torch.tensor([0.1, -1.0, 0.7, 0.2]), g) == 2
