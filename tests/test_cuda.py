"""The CUDA path: same greedy tokens as the CPU, speculation lossless, seeded sampling stable.
Marked `gpu`; skipped where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 90 for j in range(5 + 3 * i)])
           for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(llm, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_cuda_greedy_matches_cpu(llama_dir):
    assert _tokens(LLM(str(llama_dir), device="cuda")) == _tokens(LLM(str(llama_dir), device="cpu"))


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    {"method": "suffix", "num_speculative_tokens": 3},
])
def test_cuda_speculation_is_lossless(llama_dir, spec):
    ref = _tokens(LLM(str(llama_dir), device="cuda"))
    assert _tokens(LLM(str(llama_dir), device="cuda", speculative_config=spec)) == ref


def test_cuda_draft_model_and_seeded_sampling(llama_dir, draft_dir):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    llm = LLM(str(llama_dir), device="cuda", speculative_config=spec)
    assert _tokens(llm) == _tokens(LLM(str(llama_dir), device="cuda"))
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    assert _tokens(llm, sp) == _tokens(llm, sp)


@pytest.mark.parametrize("method", [None, "ngram", "draft_model", "eagle3", "eagle"])
def test_cuda_graphs_give_the_eager_tokens(llama_dir, draft_dir, tmp_path, method):
    """Decode, verify, draft-chain and head-chain steps replayed from CUDA graphs (6 requests:
    padded to a batch of 8 through the scratch slot) give what eager steps give."""
    from tests.methods.test_heads import eagle3_ckpt, eagle_ckpt
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
            "draft_model": {"model": str(draft_dir), "num_speculative_tokens": 3},
            "eagle3": {"model": str(eagle3_ckpt(tmp_path / "h")), "num_speculative_tokens": 3},
            "eagle": {"method": "eagle", "model": str(eagle_ckpt(tmp_path / "e")),
                      "num_speculative_tokens": 3},
            None: None}[method]
    eager = LLM(str(llama_dir), device="cuda", enforce_eager=True, speculative_config=spec)
    graphed = LLM(str(llama_dir), device="cuda", speculative_config=spec)
    assert eager.engine.runner.graphs is None
    assert _tokens(graphed) == _tokens(eager)
    assert len(graphed.engine.runner.graphs.graphs) >= 1
    if method in ("eagle", "eagle3"):
        assert len(graphed.engine.proposer.graphs.graphs) >= 1     # the head's chains
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    assert _tokens(graphed, sp) == _tokens(eager, sp)


def test_cuda_hybrid_prompt_lookup_is_lossless(llama_dir, draft_dir):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3,
            "hybrid_prompt_lookup": 2}
    llm = LLM(str(llama_dir), device="cuda", speculative_config=spec)
    assert _tokens(llm) == _tokens(LLM(str(llama_dir), device="cuda"))
    assert llm.engine.proposer.num_lookup_drafts > 0
