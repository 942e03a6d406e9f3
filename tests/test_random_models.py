"""Random-weight benchmark targets of real shapes (`--target random:...`)."""

from __future__ import annotations

import json

import pytest

from specserve import LLM, SamplingParams
from specserve.bench import random_models
from tests.conftest import DEVICE
from tests.train.conftest import REPO


def test_names_and_explicit_shapes_parse_and_bad_ones_are_named():
    assert random_models.parse("random:llama-3.2-1b")["hidden"] == 2048
    assert random_models.parse("random:hidden=64,layers=2,inter=128,heads=4,kv=2") == {
        "hidden": 64, "layers": 2, "inter": 128, "heads": 4, "kv": 2}
    for bad in ("random:gpt-5", "random:hidden=64,layers=2", "random:hidden=64,layers=2,"
                "inter=128,heads=4,kv=3", "random:hidden=x,layers=2,inter=1,heads=1,kv=1"):
        with pytest.raises(SystemExit, match="random:"):
            random_models.parse(bad)


def test_a_random_model_is_built_once_and_serves_with_synthetic_acceptance(tmp_path):
    spec = "random:hidden=64,layers=2,inter=128,heads=4,kv=2"
    tok = REPO / "models" / "code-target"
    path = random_models.materialize(spec, tok, root=tmp_path)
    assert random_models.materialize(spec, tok, root=tmp_path) == path        # cached
    cfg = json.loads((tmp_path / path.split("/")[-1] / "config.json").read_text())
    assert cfg["vocab_size"] == 8192 and cfg["num_hidden_layers"] == 2
    llm = LLM(path, device=DEVICE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.0})
    out = llm.generate("def f(x): return f(x)", SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8


def test_random_heads_are_built_beside_a_random_target_and_draft(tmp_path):
    spec = "random:hidden=64,layers=4,inter=128,heads=4,kv=2"
    path = random_models.materialize(spec, REPO / "models" / "code-target", root=tmp_path)
    random_models.random_heads(path)
    random_models.random_pard(path)
    llm = LLM(path, device=DEVICE, speculative_config={
        "model": f"{path}-pard", "num_speculative_tokens": 4, "parallel_drafting": True})
    llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for name, (method, options) in random_models.RANDOM_HEADS.items():
        llm = LLM(path, device=DEVICE, speculative_config={
            "model": f"{path}-{name}", "num_speculative_tokens": 4,
            "parallel_drafting": bool(options.get("parallel")),
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.0})
        assert llm.engine.spec.method == method
        llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                     use_tqdm=False)
        assert llm.get_stats()["mean_acceptance_length"] == pytest.approx(5.0, abs=0.5)
