import pytest

from specserve import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, r"temperature must be 0 \(greedy\) or at least 1e-05"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 0}, "top_k must be -1"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"n": 0}, "n must be an integer >= 1"),
    ({"logprobs": 50}, r"logprobs must be in \[0, 20\]"),
    ({"stop": [""]}, "stop must be a non-empty string"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="x").stop_strings == ["x"]


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": 1e-40}, r"temperature must be 0 \(greedy\) or at least 1e-05"),
    ({"temperature": 1e-6}, r"temperature must be 0 \(greedy\) or at least 1e-05"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"top_p": 1e-46}, "not round to 0 in float32"),
    ({"min_p": float("nan")}, "min_p must be a finite number"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"seed": 2**64}, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
    ({"seed": -(2**63) - 1}, "seed must be an integer"),
])
def test_degenerate_sampling_values_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1e-5}, {"temperature": 0}, {"top_p": 1.4e-45}, {"seed": 2**64 - 1},
    {"seed": -(2**63)}, {"min_p": 1.0}])
def test_boundary_sampling_values_sample(kwargs):
    """The smallest accepted values really sample: a finite distribution, a valid token."""
    import torch

    from specserve.sampling.sampler import process_logits, sample_from
    params = SamplingParams(**{"temperature": 1.0} | kwargs)
    if params.is_greedy:
        return
    logits = torch.randn(2, 50) * 300                       # large logits: the worst case
    probs = process_logits(logits, [params] * 2)
    assert probs.isfinite().all() and (probs.sum(-1) > 0).all()
    g = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    assert 0 <= sample_from(probs[0], g) < 50
