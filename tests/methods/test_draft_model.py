"""The draft-model proposer on its own, built from a DraftContext: its context cap, its KV
cache, its vocabulary check."""

from __future__ import annotations

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.methods.base import DraftContext
from specserve.methods.draft_model import DraftModelProposer
from specserve.models.backend import Backend
from specserve.models.loader import load_model
from tests.conftest import DEVICE, make_hf_model

CPU = torch.device("cpu")


def _ctx(target_dir, max_model_len: int = 200) -> DraftContext:
    target = load_model(target_dir, torch.float32, CPU)
    return DraftContext(target=target, target_path=str(target_dir), num_slots=3,
                        max_model_len=max_model_len,
                        vocab_size=target.args.vocab_size,
                        backend=Backend(CPU, torch.float32, cpu_kernel=True))


def test_it_caps_the_context_at_the_drafts_and_keeps_a_cache_per_slot(llama_dir, tmp_path):
    make_hf_model("llama", tmp_path / "short", seed=4, hidden_size=32, num_hidden_layers=1,
                  intermediate_size=64, max_position_embeddings=100)
    config = SpeculativeConfig(method="draft_model", model=str(tmp_path / "short"),
                               num_speculative_tokens=3)
    p = DraftModelProposer(config, _ctx(llama_dir))
    assert p.max_model_len == 100                     # the engine takes min(target, this)
    (cache,) = p.caches
    assert cache.num_slots == 3 and cache.max_len == 100 and len(cache.layers) == 1
    assert p.modules == {"draft model": p.model} and p.aux_hidden_layers == ()


def test_a_draft_with_another_vocabulary_is_refused(llama_dir, tmp_path):
    make_hf_model("llama", tmp_path / "other", seed=5, vocab=80, hidden_size=32,
                  num_hidden_layers=1, intermediate_size=64)
    config = SpeculativeConfig(method="draft_model", model=str(tmp_path / "other"),
                               num_speculative_tokens=3)
    with pytest.raises(ValueError, match="has vocab_size 80 but the target has 96"):
        DraftModelProposer(config, _ctx(llama_dir))


def test_synthetic_rejections_of_tokens_equal_to_the_draft_never_starve_it(llama_dir):
    """The target as its own draft under synthetic verification: a rejected draft is followed by
    the target's token, which equals it; the draft must still be fed the last token."""
    from specserve import LLM, SamplingParams, TokensPrompt
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config={
        "model": str(llama_dir), "num_speculative_tokens": 4,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.5})
    outs = llm.generate([TokensPrompt(prompt_token_ids=[5 + i, 9, 13]) for i in range(4)],
                        [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, seed=i)
                         for i in range(4)], use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 40
               for o in outs)
