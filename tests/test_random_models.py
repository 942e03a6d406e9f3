"""Random-weight benchmark targets of real shapes (`--target random:...`)."""

from __future__ import annotations

import json

import pytest

from specserve import LLM, SamplingParams, TokensPrompt
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


def test_a_padded_model_reads_more_bytes_and_keeps_its_function_and_heads(tmp_path):
    """`padded:DIR,inter=N`: wider MLPs whose extra columns add nothing, so greedy output is
    DIR's token for token, and DIR's heads are linked beside it and draft as they do for DIR
    (the same acceptance); MTP, which lives in the target's checkpoint, is not linked."""
    from tests.conftest import make_hf_model
    from tests.methods.test_heads import eagle3_ckpt
    src = tmp_path / "m"
    make_hf_model("llama", src)
    eagle3_ckpt(tmp_path / "m-eagle3")
    (tmp_path / "m-mtp").mkdir()
    (tmp_path / "m-mtp" / "config.json").write_text("{}")
    spec = f"padded:{src},inter=512"
    path = random_models.padded(spec, root=tmp_path / "out")
    built = (tmp_path / "out" / "m-inter512" / "model.safetensors").stat().st_mtime_ns
    assert random_models.padded(spec, root=tmp_path / "out") == path
    assert (tmp_path / "out" / "m-inter512" / "model.safetensors").stat().st_mtime_ns == built
    assert json.loads((tmp_path / "out" / "m-inter512" / "config.json").read_text())[
        "intermediate_size"] == 512
    assert (tmp_path / "out" / "m-inter512-eagle3").resolve() == tmp_path / "m-eagle3"
    assert not (tmp_path / "out" / "m-inter512-mtp").exists()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs, accepted = [], []
    for target in (str(src), path):
        llm = LLM(target, device=DEVICE, speculative_config={
            "model": f"{target}-eagle3", "num_speculative_tokens": 3})
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ([5, 6, 7, 8], [9, 3])]
        outs.append([o.outputs[0].token_ids
                     for o in llm.generate(prompts, greedy, use_tqdm=False)])
        accepted.append(llm.get_stats()["spec_decode_num_accepted_tokens"])
    assert outs[0] == outs[1] and accepted[0] == accepted[1]
    # DIR itself drafting for the padded model: every draft is its next token
    llm = LLM(path, device=DEVICE, speculative_config={"model": str(src),
                                                       "num_speculative_tokens": 3})
    llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.get_stats()["acceptance_rate"] == 1.0
    with pytest.raises(SystemExit, match="must exceed"):
        random_models.padded(f"padded:{src},inter=64", root=tmp_path / "out")
