"""Every speculative_config key does something: for each, two configurations that differ only
in it measurably behave differently (drafts, acceptance, counters), or the value is refused.
A key added without a case here fails `test_every_key_has_a_case`."""

from __future__ import annotations

import dataclasses
import types

import pytest

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.config import SpeculativeConfig
from specserve.methods import resolve_speculative_config
from tests.conftest import DEVICE
from tests.methods.test_heads import eagle3_ckpt
from tests.test_spec_decode import repetitive_prompts

PROMPTS = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(4, seed=7)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}


def _draft(draft_dir) -> dict:
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}


def _pard(p) -> str:
    """The target with a mask token in its config (what a PARD draft has): drafting itself
    autoregressively it is always accepted, drafting behind masks it was not trained for not."""
    from tests.methods.test_pard import _with_mask
    d = p.tmp / "pard"
    return str(d if d.is_dir() else _with_mask(p.target, d))


def _extract(p, name: str) -> dict:
    return {"method": "extract_hidden_states", "hidden_states_dir": str(p.tmp / name)}


def _run(llama_dir, spec: dict | None, temperature: float = 0.0, prompts=PROMPTS,
         rounds: int = 1) -> dict:
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=spec, max_num_seqs=4)
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=24, ignore_eos=True)
    for _ in range(rounds):
        outs = llm.generate(prompts, params, use_tqdm=False)
    return llm.get_stats() | {"tokens": [o.outputs[0].token_ids for o in outs]}


# key -> (base config, the same with the key changed, extra run arguments); the two runs' stats
# must differ. Configs are functions of `p` (p.target, p.draft, p.tmp: directories).
CASES = {
    "method": (lambda p: NGRAM, lambda p: SUFFIX | {"prompt_lookup_min": None}, {}),
    # the target as its own draft accepts every draft; the small draft does not
    "model": (lambda p: _draft(p.draft), lambda p: _draft(p.target), {}),
    "num_speculative_tokens": (lambda p: NGRAM, lambda p: NGRAM | {
        "num_speculative_tokens": 1}, {}),
    "prompt_lookup_min": (lambda p: NGRAM, lambda p: NGRAM | {"prompt_lookup_min": 4,
                                                                    "prompt_lookup_max": 4}, {}),
    "prompt_lookup_max": (lambda p: NGRAM | {"prompt_lookup_max": 1},
                          lambda p: NGRAM | {"prompt_lookup_max": 6}, {}),
    "suffix_decoding_max_tree_depth": (lambda p: SUFFIX, lambda p: SUFFIX | {
        "suffix_decoding_max_tree_depth": 1}, {}),
    "suffix_decoding_max_cached_requests": (lambda p: SUFFIX, lambda p: SUFFIX | {
        "suffix_decoding_max_cached_requests": 0}, {"rounds": 2}),
    "suffix_decoding_max_spec_factor": (lambda p: SUFFIX, lambda p: SUFFIX | {
        "suffix_decoding_max_spec_factor": 0.2}, {}),
    "suffix_decoding_min_token_prob": (lambda p: SUFFIX, lambda p: SUFFIX | {
        "suffix_decoding_min_token_prob": 0.99}, {}),
    "max_model_len": (lambda p: NGRAM, lambda p: NGRAM | {"max_model_len": 20}, {}),
    "rejection_sample_method": (lambda p: NGRAM, lambda p: NGRAM | {
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.0}, {}),
    "synthetic_acceptance_rate": (
        lambda p: NGRAM | {"rejection_sample_method": "synthetic",
                              "synthetic_acceptance_rate": 0.0},
        lambda p: NGRAM | {"rejection_sample_method": "synthetic",
                              "synthetic_acceptance_rate": 1.0}, {}),
    "synthetic_acceptance_rates": (
        lambda p: NGRAM | {"rejection_sample_method": "synthetic",
                              "synthetic_acceptance_rates": [1.0, 1.0, 1.0]},
        lambda p: NGRAM | {"rejection_sample_method": "synthetic",
                              "synthetic_acceptance_rates": [1.0, 0.0, 0.0]}, {}),
    "synthetic_acceptance_length": (
        lambda p: NGRAM | {"rejection_sample_method": "synthetic",
                              "synthetic_acceptance_length": 1.0},
        lambda p: NGRAM | {"rejection_sample_method": "synthetic",
                              "synthetic_acceptance_length": 4.0}, {}),
    "draft_sample_method": (lambda p: _draft(p.draft), lambda p: _draft(p.draft) | {
        "draft_sample_method": "probabilistic"}, {"temperature": 1.0}),
    "disable_by_batch_size": (lambda p: NGRAM, lambda p: NGRAM | {
        "disable_by_batch_size": 2}, {}),
    "num_speculative_tokens_per_batch_size": (lambda p: NGRAM, lambda p: NGRAM | {
        "num_speculative_tokens_per_batch_size": [[1, 100, 1]]}, {}),
    "draft_confidence_threshold": (lambda p: _draft(p.draft), lambda p: _draft(p.draft) | {
        "draft_confidence_threshold": 0.9}, {}),
    "speculative_token_tree": (
        lambda p: {"model": str(eagle3_ckpt(p.tmp / "e3")), "num_speculative_tokens": 3},
        lambda p: {"model": str(eagle3_ckpt(p.tmp / "e3")),
                      "speculative_token_tree": "[(0,), (1,), (0, 0)]"}, {}),
    # an int8 drafter drafts (slightly) different tokens: other acceptance counts
    "quantization": (lambda p: _draft(p.draft), lambda p: _draft(p.draft) | {
        "quantization": "int8"}, {}),
    "hybrid_prompt_lookup": (lambda p: _draft(p.draft), lambda p: _draft(p.draft) | {
        "hybrid_prompt_lookup": 1}, {}),
    "adaptive_k": (lambda p: NGRAM, lambda p: NGRAM | {"adaptive_k": True}, {}),
    "parallel_drafting": (lambda p: _draft(p.draft) | {"model": _pard(p)},
                          lambda p: _draft(p.draft) | {"model": _pard(p),
                                                       "parallel_drafting": True}, {}),
    "hidden_states_layers": (lambda p: _extract(p, "a"),
                             lambda p: _extract(p, "b") | {"hidden_states_layers": [0]}, {}),
    "hidden_states_max_bytes": (lambda p: _extract(p, "a"),
                                lambda p: _extract(p, "b") | {"hidden_states_max_bytes": 1}, {}),
}
# keys whose only valid value here is the default: others are refused (draft_tensor_parallel_size
# may also equal the target's tensor_parallel_size: tests/engine/test_tensor_parallel.py)
REFUSED = {"draft_tensor_parallel_size": (0, "draft_tensor_parallel_size must be >= 1"),
           # what it does (where the files go) is tested in tests/train/test_heads.py
           "hidden_states_dir": ("d", "applies to method 'extract_hidden_states' only")}


def test_every_key_has_a_case():
    keys = {f.name for f in dataclasses.fields(SpeculativeConfig) if f.init}   # user keys
    assert keys == set(CASES) | set(REFUSED)


@pytest.mark.parametrize("key", sorted(CASES))
def test_the_key_changes_behaviour(key, llama_dir, draft_dir, tmp_path):
    base, changed, kw = CASES[key]
    p = types.SimpleNamespace(target=llama_dir, draft=draft_dir, tmp=tmp_path)
    a, b = (_run(llama_dir, cfg(p), **kw) for cfg in (base, changed))
    differing = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differing, f"{key}: the same behaviour with and without it"


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_the_key_refuses_other_values(key):
    value, match = REFUSED[key]
    with pytest.raises(ValueError, match=match):
        resolve_speculative_config(NGRAM | {key: value})
