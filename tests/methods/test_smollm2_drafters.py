"""The drafters bundled for SmolLM2-135M-Instruct load by catalogue name, are lossless, and are
trained: their acceptance on held-out chat prompts is well above a head that guesses."""

from __future__ import annotations

import json

from specserve import LLM, SamplingParams
from specserve.data.chat_prompts import chat_prompts
from specserve.models.catalogue import BUNDLED, bundled_drafters

GREEDY = SamplingParams(temperature=0, max_tokens=48)


def test_the_eagle3_head_is_lossless_and_accepted(smollm2):
    assert "smollm2-135m-instruct-eagle3" in bundled_drafters("smollm2-135m-instruct")
    conversations = [[{"role": "user", "content": p}] for p in chat_prompts("heldout")[:4]]
    ref = LLM("smollm2-135m-instruct", dtype="float32").chat(conversations, GREEDY,
                                                             use_tqdm=False)
    llm = LLM("smollm2-135m-instruct", dtype="float32", speculative_config={
        "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3})
    assert llm.engine.spec.method == "eagle3"
    out = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    # greedy and deterministic: a head that had not learned SmolLM2 would stay near 1.0
    assert llm.get_stats()["mean_acceptance_length"] > 1.5
    quality = json.loads((BUNDLED / "smollm2-135m-instruct-eagle3" / "quality.json").read_text())
    assert quality["method"] == "eagle3" and quality["tau"] > 1.5


def test_the_mtp_layer_loads_by_name_and_is_lossless(smollm2):
    """The MTP layer trained for the frozen SmolLM2 (its embedding and lm_head shared), loaded as
    {"method": "mtp", "model": "smollm2-135m-instruct-mtp"} beside the GGUF target."""
    assert "smollm2-135m-instruct-mtp" in bundled_drafters("smollm2-135m-instruct")
    conversations = [[{"role": "user", "content": p}] for p in chat_prompts("heldout")[4:7]]
    kw = {"dtype": "float32", "max_num_seqs": 3, "max_model_len": 1024}
    ref = LLM("smollm2-135m-instruct", **kw).chat(conversations, GREEDY, use_tqdm=False)
    llm = LLM("smollm2-135m-instruct", speculative_config={
        "method": "mtp", "model": "smollm2-135m-instruct-mtp", "num_speculative_tokens": 2}, **kw)
    out = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.get_stats()["mean_acceptance_length"] > 1.3
    quality = json.loads((BUNDLED / "smollm2-135m-instruct-mtp" / "quality.json").read_text())
    assert quality["method"] == "mtp" and quality["tau_per_k"]["temperature 0.0"]["1"] > 1.3
