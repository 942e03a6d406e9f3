"""The method registry: one record per method, K from a checkpoint, and a method added by one
registry entry runs end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve import LLM, SamplingParams, TokensPrompt, methods
from specserve.methods.base import MethodSpec, Proposal, ProposerBase
from tests.conftest import DEVICE

ZOO = Path(__file__).resolve().parents[2] / "models"


def test_every_method_has_one_complete_record():
    names = [n for s in methods.REGISTRY.values() for n in (s.name, *s.aliases)]
    assert len(names) == len(set(names))
    for spec in methods.REGISTRY.values():
        head = (spec.new_head, spec.read, spec.write, spec.loss)
        assert all(head) or not any(head), spec.name          # a head has all four
        if spec.new_head is not None:
            assert spec.reads_hidden_states
    assert set(methods.head_methods()) == {"dflash", "eagle", "eagle3", "medusa", "mlp_speculator",
                                          "mtp"}
    with pytest.raises(ValueError, match="method 'nope' is not known; use one of ngram"):
        methods.get("nope")


@pytest.mark.parametrize("spec, target, k", [
    ({"model": str(ZOO / "code-target-medusa")}, None, 4),              # num_heads
    ({"model": str(ZOO / "code-target-mlp-speculator")}, None, 4),      # n_predict
    ({"method": "mtp"}, str(ZOO / "code-target-mtp"), 1),               # MTP layers
    ({"model": str(ZOO / "code-target-medusa"), "num_speculative_tokens": 2}, None, 2),
    ({"method": "suffix"}, None, 24),                                   # the tree depth
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 8}, None, 8),
])
def test_k_comes_from_the_checkpoint_when_left_out(spec, target, k):
    assert methods.resolve_speculative_config(spec, target).num_speculative_tokens == k


def test_a_method_without_k_in_its_checkpoint_needs_it():
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        methods.resolve_speculative_config({"model": str(ZOO / "code-target-eagle3")})
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        methods.resolve_speculative_config({"method": "ngram"})


class Repeat(ProposerBase):
    """Drafts the last token again, K times: a method in a dozen lines."""

    def __init__(self, config, ctx) -> None:
        assert ctx.vocab_size == 96 and ctx.num_target_layers == 2
        self.calls = 0

    def propose(self, batch):
        self.calls += 1
        return [Proposal([r.all_token_ids[-1]] * k)
                for r, k in zip(batch.requests, batch.max_num_tokens)]


def test_a_method_added_by_one_registry_entry_runs_losslessly(llama_dir, monkeypatch):
    monkeypatch.setitem(methods.REGISTRY, "repeat",
                        MethodSpec(name="repeat", build=Repeat, summary="the last token again"))
    prompts = [TokensPrompt(prompt_token_ids=[5, 5, 5, 7, 5, 5])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(str(llama_dir), device=DEVICE).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(llama_dir), device=DEVICE,
              speculative_config={"method": "repeat", "num_speculative_tokens": 3})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.engine.proposer.calls > 0 and llm.get_stats()["spec_decode_num_drafts"] > 0


def test_mtp_past_its_layers_warns_as_vllm_does(caplog):
    import logging
    caplog.set_level(logging.WARNING, logger="specserve")
    LLM(str(ZOO / "code-target-mtp"), device=DEVICE,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert any("3x the 1 this mtp checkpoint predicts" in r.getMessage() for r in caplog.records)
    caplog.clear()
    LLM(str(ZOO / "code-target-mtp"), device=DEVICE, speculative_config={"method": "mtp"})
    assert not any("predicts" in r.getMessage() for r in caplog.records)    # K = its 1 layer


def test_k_past_n_predict_must_be_a_multiple_and_medusa_heads_run_in_turn(llama_dir, tmp_path):
    from tests.methods.test_heads import medusa_ckpt
    with pytest.raises(ValueError, match="more than the 4 tokens this medusa checkpoint "
                                         "predicts, and not a multiple"):
        methods.resolve_speculative_config({"model": str(ZOO / "code-target-medusa"),
                                            "num_speculative_tokens": 6})
    with pytest.raises(ValueError, match="predicts 4 tokens"):        # IBM's stages: no cycling
        LLM(str(ZOO / "code-target"), device=DEVICE, speculative_config={
            "model": str(ZOO / "code-target-mlp-speculator"), "num_speculative_tokens": 8})
    path = medusa_ckpt(tmp_path / "m")
    n = methods.resolve_speculative_config({"model": str(path)}).num_speculative_tokens
    llm = LLM(str(llama_dir), device=DEVICE,
              speculative_config={"model": str(path), "num_speculative_tokens": 2 * n})
    recorded = []
    propose = llm.engine.proposer.propose

    def record(batch):
        props = propose(batch)
        recorded.extend(p.token_ids for p in props)
        return props
    llm.engine.proposer.propose = record
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(str(llama_dir), device=DEVICE).generate(
        [TokensPrompt(prompt_token_ids=[3, 4, 5])], params, use_tqdm=False)
    got = llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5])], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    full = [d for d in recorded if len(d) == 2 * n]
    assert full and all(d[:n] == d[n:] for d in full)       # the heads' drafts again, in turn
