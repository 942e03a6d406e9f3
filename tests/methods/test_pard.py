"""Parallel drafting with a draft model (PARD): K drafts from one pass over the new tokens and
K-1 mask tokens, lossless, the masks' KV never read as context, and its loading errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specserve import LLM, TokensPrompt
from specserve.kernels.cpu import load_library
from specserve.models.loader import load_model
from tests.conftest import DEVICE, make_hf_model
from tests.test_spec_decode import (
    N_SAMPLES,
    TV_BOUND,
    _exact_pair_distribution,
    _greedy,
    _token_hist,
    assert_lossless_alone_and_mixed,
    repetitive_prompts,
    small_vocab_pair,  # noqa: F401  (a fixture)
)

MASK = 93


def _with_mask(src, dst, mask: int = MASK):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | {"pard_token": mask}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def pard_dir(draft_dir, tmp_path_factory):
    return _with_mask(draft_dir, tmp_path_factory.mktemp("pard") / "d")


def _spec(path, k: int, **kw) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, "parallel_drafting": True} | kw


@pytest.mark.parametrize("k", [2, 4, 8])
def test_greedy_output_is_the_targets_alone_and_in_mixed_batches(llama_dir, pard_dir, k):
    assert_lossless_alone_and_mixed(llama_dir, _spec(pard_dir, k), num_prompts=10,
                                    max_model_len=80)


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "pytorch-pass"])
def test_one_draft_pass_per_step_and_the_masks_kv_is_never_context(llama_dir, pard_dir,
                                                                   one_call):
    """Every proposal equals the draft model's greedy tokens at the last real position and
    each mask position of a dense pass over the whole context (no cache): had a step's mask
    KV been kept as context, later drafts would differ. One pass a step, in one C call on the
    CPU kernel (the pass and the picks; a prompt past the kernel's row limit in PyTorch) or
    in PyTorch."""
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(pard_dir, 4))
    proposer = llm.engine.proposer
    if not one_call:
        proposer.chain = None
    elif DEVICE == "cpu" and load_library() is not None:
        assert proposer.chain is not None
    dense = load_model(pard_dir, torch.float32, torch.device(DEVICE))
    passes, checked, steps = {"pytorch": 0, "c": 0}, [0], [0]
    for name, key in (("_forward", "pytorch"), ("_ingest", "c")):
        run = getattr(proposer, name)
        setattr(proposer, name, lambda *a, _run=run, _key=key, **kw:
                passes.__setitem__(_key, passes[_key] + 1) or _run(*a, **kw))
    propose = proposer.propose

    def checked_propose(batch):
        n = sum(passes.values())
        out = propose(batch)
        assert sum(passes.values()) == n + (1 if batch.requests else 0)   # one pass for all K
        steps[0] += bool(batch.requests)
        for r, p, k in zip(batch.requests, out, batch.max_num_tokens):
            ids = r.all_token_ids + [MASK] * (k - 1)
            with torch.inference_mode():
                x = torch.tensor([ids], device=dense.embed_tokens.weight.device)
                h = dense(x, torch.arange(len(ids), device=x.device)[None])[0]
                want = dense.compute_logits(h[-k:]).argmax(-1).tolist()
            assert p.token_ids == want
            checked[0] += 1
        return out

    proposer.propose = checked_propose
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(4, seed=6)]
    llm.generate(ps, _greedy(30), use_tqdm=False)
    assert checked[0] > 20
    assert (passes["c"] > steps[0] // 2) == (proposer.chain is not None)


@pytest.mark.parametrize("rejection, draft_sample", [("strict", "greedy"),
                                                     ("probabilistic", "probabilistic")])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path,  # noqa: F811
                                                 rejection, draft_sample):
    target, draft = small_vocab_pair
    pard = _with_mask(draft, tmp_path / "pard8", mask=6)
    llm = LLM(str(target), device=DEVICE, max_num_seqs=64, max_num_batched_tokens=512,
              speculative_config=_spec(pard, 2, rejection_sample_method=rejection,
                                       draft_sample_method=draft_sample))
    exact = _exact_pair_distribution(target)
    tv = 0.5 * (_token_hist(llm, N_SAMPLES, 200_000) - exact).abs().sum().item()
    assert llm.get_stats()["acceptance_rate"] < 0.95
    assert tv < TV_BOUND, f"total variation {tv:.3f} from the target's exact distribution"


def test_a_draft_without_a_mask_token_and_other_methods_are_refused(llama_dir, draft_dir):
    with pytest.raises(ValueError, match="needs a drafter trained for it.*pard_token"):
        LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(draft_dir, 4))
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "suffix", "num_speculative_tokens": 3}):
        with pytest.raises(ValueError, match="parallel_drafting applies to draft_model, eagle3, dflash, not"):
            LLM(str(llama_dir), device=DEVICE, speculative_config=spec | {
                "parallel_drafting": True})


def test_the_training_layout_is_what_inference_sees(tmp_path):
    """Row (copy c, position j) of the PARD training pass equals the last row of a causal pass
    over x[0..j-c] followed by c masks: the layout teaches what inference asks."""
    from specserve.methods.parallel import pard_mask
    make_hf_model("llama", tmp_path / "m", seed=7)
    model = load_model(tmp_path / "m", torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    L, K = 12, 4
    x = torch.randint(0, 90, (L,), generator=g)
    inputs = torch.cat([x, torch.full(((K - 1) * L,), MASK)])[None]
    with torch.no_grad():
        rows = model(inputs, torch.arange(L).repeat(K)[None], mask=pard_mask(L, K))[0]
        for c in range(K):
            for j in range(c, L):
                ids = torch.cat([x[:j - c + 1], torch.full((c,), MASK)])[None]
                want = model(ids, torch.arange(ids.shape[1])[None])[0, -1]
                torch.testing.assert_close(rows[c * L + j], want, atol=1e-5, rtol=1e-5)


def test_a_confidence_threshold_cuts_the_parallel_drafts(llama_dir, pard_dir):
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(4, seed=4)]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device=DEVICE).generate(
        ps, _greedy(30), use_tqdm=False)]
    stats = []
    for threshold in (0.0, 0.3):
        llm = LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(
            pard_dir, 4, draft_confidence_threshold=threshold))
        got = [o.outputs[0].token_ids for o in llm.generate(ps, _greedy(30), use_tqdm=False)]
        assert got == ref
        m = llm.get_stats()
        stats.append(m["spec_decode_num_draft_tokens"] / m["spec_decode_num_drafts"])
    assert stats[1] < stats[0]              # some drafts stopped at an unsure token
