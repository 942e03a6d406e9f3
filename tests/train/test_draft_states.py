"""`specserve train draft|pard --hidden-states`: a draft model learnt from a target's extracted
answers and states (the real-target path: no target pass per step), lossless when it drafts."""

from __future__ import annotations

import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model
from specserve.train.draft_states import embedding_from_target, train_draft_on_states
from specserve.train.lm import ModelShape
from specserve.train.trainer import TrainConfig
from tests.conftest import DEVICE
from tests.train.test_heads import _extract

SHAPE = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   intermediate_size=64, tie_embeddings=True, max_position_embeddings=128)


def test_a_fresh_draft_starts_from_the_targets_embedding(tiny_lm):
    """At the target's width the projection is a rotation: every inner product of two token
    embeddings is the target's, times one scale."""
    target = load_model(tiny_lm[0], torch.float32, torch.device("cpu"))
    e = target.embed_tokens.weight.detach()
    same = LlamaForCausalLM(ModelShape(hidden_size=e.shape[1], num_heads=4, num_kv_heads=2,
                                       tie_embeddings=True).args(e.shape[0]))
    embedding_from_target(same, target)
    d = same.embed_tokens.weight.detach()
    gram, own = d @ d.T, e @ e.T
    torch.testing.assert_close(gram, own * (gram.norm() / own.norm()), atol=1e-4, rtol=1e-3)
    narrow = LlamaForCausalLM(SHAPE.args(e.shape[0]))
    embedding_from_target(narrow, target)
    assert narrow.lm_head.weight.data_ptr() == narrow.embed_tokens.weight.data_ptr()
    assert narrow.embed_tokens.weight.std().item() == pytest.approx(e.std().item(), rel=1e-3)
    wide = LlamaForCausalLM(ModelShape(hidden_size=2 * e.shape[1], num_heads=4,
                                       num_kv_heads=2).args(e.shape[0]))
    with pytest.raises(ValueError, match="wider than the target"):
        embedding_from_target(wide, target)


@pytest.mark.parametrize("pard_k", [None, 3])
def test_a_draft_trained_on_extracted_states_drafts_losslessly(pard_k, tiny_lm, tmp_path):
    target, _, _ = tiny_lm
    _extract(target, tmp_path / "states")
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=3, batch_size=2, seq_len=24, lr=3e-3,
                      warmup=1, bf16=False, device=DEVICE)
    quality = train_draft_on_states(cfg, SHAPE, target, tmp_path / "draft", tmp_path / "states",
                                    pard_k=pard_k, eval_k=2)
    out = tmp_path / "draft"
    assert quality == json.loads((out / "quality.json").read_text())
    assert set(quality["tau_per_k"]["temperature 0.0"]) == {"1", "2"}
    assert all(1 <= t <= 3 for per_k in quality["tau_per_k"].values() for t in per_k.values())
    assert (out / "tokenizer.json").is_file() and (out / "loss.png").is_file()
    config = json.loads((out / "config.json").read_text())
    assert ("pard_token" in config) == (pard_k is not None)
    assert ("tau_per_k_parallel" in quality) == (pard_k is not None)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(str(target), device=DEVICE).generate("def f(x):", sp, use_tqdm=False)
    for extra in ({}, {"parallel_drafting": True} if pard_k else {}):
        llm = LLM(str(target), device=DEVICE, speculative_config={
            "method": "draft_model", "model": str(out), "num_speculative_tokens": 2, **extra})
        got = llm.generate("def f(x):", sp, use_tqdm=False)
        assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert llm.get_stats()["spec_decode_num_drafts"] > 0
    # a second run finds the finished checkpoint and only writes the model again
    assert train_draft_on_states(cfg, SHAPE, target, out, tmp_path / "states",
                                 pard_k=pard_k, eval_k=2)["train_steps"] == 3
