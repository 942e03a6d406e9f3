"""method "auto": the drafter available for the target, said in stats and the backend line,
with prompt lookup and K chosen per step; lossless whatever it picks."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.methods import AUTO_CONFIDENCE, AUTO_K
from tests.conftest import DEVICE
from tests.methods.test_heads import eagle3_ckpt, mtp_target
from tests.test_spec_decode import repetitive_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _lossless(target, spec: dict) -> LLM:
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(4, seed=2)]
    ref = LLM(str(target), device=DEVICE).generate(ps, GREEDY, use_tqdm=False)
    llm = LLM(str(target), device=DEVICE, speculative_config=spec)
    out = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    return llm


@pytest.mark.parametrize("case", ["nothing", "given", "mtp"])
def test_auto_picks_what_the_target_has(case, llama_dir, tmp_path):
    target, spec = llama_dir, {"method": "auto"}
    if case == "given":
        spec["model"] = str(eagle3_ckpt(tmp_path / "e3"))
    elif case == "mtp":
        target = mtp_target(tmp_path / "mtp")
    llm = _lossless(target, spec)
    s = llm.engine.spec
    method, why = {"nothing": ("ngram", "ngram: no drafter for this target"),
                   "given": ("eagle3", "the drafter given"),
                   "mtp": ("mtp", "the target's own MTP layers")}[case]
    assert s.method == method and s.adaptive_k and why in llm.get_stats()["auto_choice"]
    assert (s.hybrid_prompt_lookup is not None) == (method != "ngram")
    # a drafter that drafts token by token stops below a confidence (prompt lookup has none)
    assert s.draft_confidence_threshold == (0 if method == "ngram" else AUTO_CONFIDENCE)
    assert ("confidence" in llm.get_stats()["auto_choice"]) == (method != "ngram")
    if case == "nothing":
        assert s.num_speculative_tokens == AUTO_K
    assert sum(llm.get_stats()["adaptive_k_choices"].values()) > 0


def test_auto_finds_the_drafter_bundled_for_smollm2(smollm2):
    chat = [[{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=32)
    kw = {"dtype": "float32", "max_num_seqs": 1, "max_model_len": 1024}
    ref = LLM("smollm2-135m-instruct", **kw).chat(chat, params, use_tqdm=False)
    llm = LLM("smollm2-135m-instruct", speculative_config={"method": "auto"}, **kw)
    assert llm.engine.spec.method == "eagle3" and llm.engine.spec.num_speculative_tokens == AUTO_K
    assert "smollm2-135m-instruct-eagle3, bundled for this target" in (
        llm.get_stats()["auto_choice"])
    out = llm.chat(chat, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
