import pytest

from specserve import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, r"temperature must be 0 \(greedy\) or at least 1e-05"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 0}, "top_k must be -1"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"n": 2}, "n=2 is not supported"),
    ({"logprobs": 50}, r"logprobs must be in \[0, 20\]"),
    ({"stop": [""]}, "stop must be a non-empty string"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="x").stop_strings == ["x"]
