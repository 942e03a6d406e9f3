"""The drafters bundled for SmolLM2-135M-Instruct load by catalogue name, are lossless, and are
trained: their acceptance on held-out chat prompts is well above a head that guesses."""

from __future__ import annotations

import json

import pytest

from specserve import LLM, SamplingParams
from specserve.data.chat_prompts import chat_prompts
from specserve.models.catalogue import BUNDLED, bundled_drafters

GREEDY = SamplingParams(temperature=0, max_tokens=48)


def test_the_eagle3_head_is_lossless_and_accepted(smollm2):
    assert "smollm2-135m-instruct-eagle3" in bundled_drafters("smollm2-135m-instruct")
    conversations = [[{"role": "user", "content": p}] for p in chat_prompts("heldout")[:4]]
    kw = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 1024}
    ref = LLM("smollm2-135m-instruct", **kw).chat(conversations, GREEDY, use_tqdm=False)
    llm = LLM("smollm2-135m-instruct", speculative_config={
        "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3}, **kw)
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


# acceptance bounds well above a head that guesses (1.0), below each head's held-out tau
@pytest.mark.parametrize("method, k, tau", [("eagle", 3, 1.3), ("medusa", 3, 1.08),
                                            ("dflash", 4, 1.2)])
def test_the_eagle_medusa_and_dflash_drafters_load_by_name_and_are_lossless(smollm2, method, k,
                                                                             tau):
    """EAGLE-1 and Medusa heads and a DFlash drafter trained for SmolLM2, sharing its embedding
    and lm_head (the directories hold the drafters alone), lossless beside the GGUF by
    catalogue name."""
    name = f"smollm2-135m-instruct-{method}"
    assert name in bundled_drafters("smollm2-135m-instruct")
    conversations = [[{"role": "user", "content": p}] for p in chat_prompts("heldout")[7:10]]
    kw = {"dtype": "float32", "max_num_seqs": 3, "max_model_len": 1024}
    ref = LLM("smollm2-135m-instruct", **kw).chat(conversations, GREEDY, use_tqdm=False)
    llm = LLM("smollm2-135m-instruct", speculative_config={
        "model": name, "num_speculative_tokens": k}, **kw)
    assert llm.engine.spec.method == method
    out = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.get_stats()["mean_acceptance_length"] > tau
    quality = json.loads((BUNDLED / name / "quality.json").read_text())
    assert quality["method"] == method and quality["tau"] > tau


@pytest.mark.parametrize("name, method, extra, k, tau", [
    ("draft_model", "draft_model", {}, 3, 1.1),
    ("pard", "draft_model", {"parallel_drafting": True}, 4, 1.1),
    ("peagle", "eagle3", {"parallel_drafting": True}, 4, 1.2),
    ("mlp_speculator", "mlp_speculator", {}, 3, 1.05)])
def test_the_drafters_that_draft_in_one_pass_or_from_a_small_state_are_lossless(
        smollm2, name, method, extra, k, tau):
    """SmolLM2's draft model (its tokenizer, trained here on its answers, then for PARD) by
    catalogue name: one token a pass as `-draft_model`, K in one pass as `-pard`; the P-EAGLE
    head (`-peagle`, K in one pass of the EAGLE-3 head); the MLP speculator (its state 11 wide
    to fit the drafters' 60 MB): lossless beside the GGUF."""
    full = f"smollm2-135m-instruct-{name}"
    assert full in bundled_drafters("smollm2-135m-instruct")
    conversations = [[{"role": "user", "content": p}] for p in chat_prompts("heldout")[10:13]]
    kw = {"dtype": "float32", "max_num_seqs": 3, "max_model_len": 1024}
    ref = LLM("smollm2-135m-instruct", **kw).chat(conversations, GREEDY, use_tqdm=False)
    llm = LLM("smollm2-135m-instruct", speculative_config={
        "model": full, "num_speculative_tokens": k, **extra}, **kw)
    assert llm.engine.spec.method == method
    out = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.get_stats()["mean_acceptance_length"] > tau
    quality = json.loads((BUNDLED / full / "quality.json").read_text())
    per_k = quality["tau_per_k_parallel" if extra else "tau_per_k"]["temperature 0.0"]
    assert per_k[str(k)] > tau


TOP_K = 3               # three candidates a position: the joint law of two tokens is enumerable
N_SAMPLES = 2000
TV_BOUND = 0.06         # at most 9 cells: sampling noise in total variation is about 0.025


def test_sampling_with_the_eagle3_head_keeps_smollm2s_distribution(smollm2):
    """Sampled (temperature 1, top-k 3) through the chat template: the joint law of answer
    tokens 2 and 3, both verified against the head's drafts, equals the target's own,
    enumerated exactly with transformers' load of the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    from specserve import TokensPrompt
    kw = {"dtype": "float32", "max_num_seqs": 64, "max_model_len": 256}
    llm = LLM("smollm2-135m-instruct", speculative_config={
        "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 2}, **kw)
    prompt = llm.engine.prompt_ids(llm.engine.chat_prompt(
        [{"role": "user", "content": "Name one planet."}]))   # about half the drafts accepted
    hf = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                              dtype=torch.float32).eval()

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        top = logits.topk(TOP_K)
        return top.indices, top.values.softmax(-1)

    exact: dict[tuple[int, int], float] = {}
    ids1, p1 = probs(prompt)
    for a, pa in zip(ids1.tolist(), p1.tolist()):
        ids2, p2 = probs(prompt + [a])
        for b, pb in zip(ids2.tolist(), p2.tolist()):
            ids3, p3 = probs(prompt + [a, b])
            for c, pc in zip(ids3.tolist(), p3.tolist()):
                exact[(b, c)] = exact.get((b, c), 0.0) + pa * pb * pc
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)
              ] * N_SAMPLES             # unseeded: the rejection sampler (seeded: coupled)
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * N_SAMPLES, params,
                        use_tqdm=False)
    seen: dict[tuple[int, int], float] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[1:3])
        seen[key] = seen.get(key, 0.0) + 1 / N_SAMPLES
    tv = 0.5 * sum(abs(seen.get(k, 0.0) - exact.get(k, 0.0)) for k in set(seen) | set(exact))
    assert 0.05 < llm.get_stats()["acceptance_rate"] < 0.95     # accepts and rejections seen
    assert tv < TV_BOUND, f"total variation {tv:.3f} from the target's exact distribution"
