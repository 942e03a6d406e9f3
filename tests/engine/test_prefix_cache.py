"""Prefix caching: a prompt prefix seen before is not computed again, for the target and every
drafter, and nothing a request outputs changes (tokens, drafts, acceptance, seeded samples)."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.engine.prefix_cache import PREFIX_BLOCK_SIZE as BS
from tests.conftest import DEVICE, VOCAB
from tests.methods.test_dflash import make_dflash
from tests.methods.test_heads import eagle3_ckpt, eagle_ckpt, medusa_ckpt, mlp_speculator_ckpt
from tests.methods.test_heads import mtp_target, record_drafts
from tests.methods.test_pard import _with_mask
from tests.methods.test_peagle import make_peagle

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _ids(5 * BS + 3, seed=0)          # five whole blocks and a bit
# turns of a conversation over one prefix: each later one resends an earlier one whole
TURNS = [PREFIX + _ids(4, 1), PREFIX + _ids(11, 2), PREFIX + _ids(4, 1) + _ids(9, 3),
         PREFIX[:2 * BS] + _ids(3, 4)]


@pytest.fixture(scope="module")
def drafters(llama_dir, draft_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-drafters")
    mtp = mtp_target(root / "mtp")
    return {
        "none": (llama_dir, None),
        "ngram": (llama_dir, {"method": "ngram", "prompt_lookup_min": 1}),
        "suffix": (llama_dir, {"method": "suffix"}),
        "draft_model": (llama_dir, {"method": "draft_model", "model": str(draft_dir)}),
        "self_draft": (llama_dir, {"method": "draft_model", "model": str(llama_dir)}),
        "pard": (llama_dir, {"method": "draft_model", "parallel_drafting": True,
                             "model": str(_with_mask(draft_dir, root / "pard"))}),
        "hybrid": (llama_dir, {"method": "draft_model", "model": str(draft_dir),
                               "hybrid_prompt_lookup": 2}),
        "eagle": (llama_dir, {"method": "eagle", "model": str(eagle_ckpt(root / "eagle"))}),
        "eagle3": (llama_dir, {"method": "eagle3", "model": str(eagle3_ckpt(root / "e3"))}),
        "eagle3_tree": (llama_dir, {"method": "eagle3", "model": str(root / "e3"),
                                    "speculative_token_tree": "[(0,), (1,), (0, 0)]"}),
        "peagle": (llama_dir, {"method": "eagle3", "parallel_drafting": True,
                               "model": str(make_peagle(llama_dir, root / "peagle"))}),
        "medusa": (llama_dir, {"method": "medusa", "model": str(medusa_ckpt(root / "medusa"))}),
        "mlp_speculator": (llama_dir, {"method": "mlp_speculator",
                                       "model": str(mlp_speculator_ckpt(root / "mlp"))}),
        "mtp": (mtp, {"method": "mtp"}),
        "dflash": (llama_dir, {"method": "dflash",
                               "model": str(make_dflash(llama_dir, root / "dflash"))}),
    }


def _llm(target, spec: dict | None, **kw) -> LLM:
    spec = None if spec is None else {"num_speculative_tokens": 3} | spec
    return LLM(str(target), device=DEVICE, speculative_config=spec, **kw)


def _run(llm: LLM, prompts: list[list[int]], params=GREEDY):
    """Each prompt alone, in turn (a later one finds the earlier ones' blocks), then all at
    once in one batch (hits and misses mixed)."""
    outs = [llm.generate(TokensPrompt(prompt_token_ids=p), params, use_tqdm=False)[0]
            for p in prompts]
    outs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts + [_ids(40, 9)]],
                         params, use_tqdm=False)
    return outs


def _summary(o) -> tuple:
    m = o.spec_metrics
    drafting = None if m is None else (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)
    return o.outputs[0].token_ids, drafting


@pytest.mark.parametrize("name", ["none", "ngram", "suffix", "draft_model", "self_draft", "pard",
                                  "hybrid", "eagle", "eagle3", "eagle3_tree", "peagle", "medusa",
                                  "mlp_speculator", "mtp", "dflash"])
def test_outputs_and_drafts_equal_with_and_without_caching(name, drafters):
    """Greedy tokens, and each request's drafts and acceptance: a drafter resumed from cached
    KV drafts what it drafts having computed the prefix itself."""
    target, spec = drafters[name]
    llm_off, llm = _llm(target, spec, enable_prefix_caching=False), _llm(target, spec)
    drafts = [record_drafts(x) if spec else [] for x in (llm_off, llm)]
    off, on = _run(llm_off, TURNS), _run(llm, TURNS)
    assert [_summary(o) for o in on] == [_summary(o) for o in off]
    assert drafts[1] == drafts[0]
    cached = [o.num_cached_tokens for o in on]
    assert cached[0] == 0 and cached[1] == 5 * BS - 1 and cached[3] == 2 * BS - 1
    assert cached[2] == len(TURNS[0]) // BS * BS - 1
    assert all(n > 0 for n in cached[4:8]) and cached[8] == 0   # the batch: all but the new one
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] == sum(cached)
    assert stats["prefix_cache_queries"] == sum(len(o.prompt_token_ids) for o in on)


@pytest.mark.parametrize("name", ["none", "eagle3"])
def test_a_next_turn_reuses_the_history_with_the_answer(name, drafters):
    """A finished request's verified positions, its output's included, are kept: the next turn
    (the history and a new message) computes only what is new."""
    target, spec = drafters[name]
    llm = _llm(target, spec)
    first = llm.generate(TokensPrompt(prompt_token_ids=TURNS[0]), GREEDY, use_tqdm=False)[0]
    history = TURNS[0] + first.outputs[0].token_ids
    turn = TokensPrompt(prompt_token_ids=history + _ids(5, 8))
    out = llm.generate(turn, GREEDY, use_tqdm=False)[0]
    # the last output token's KV was never computed: the request ended on it
    assert out.num_cached_tokens == (len(history) - 1) // BS * BS - 1
    ref = _llm(target, spec, enable_prefix_caching=False).generate(turn, GREEDY, use_tqdm=False)
    assert _summary(out) == _summary(ref[0])


def test_a_block_differing_by_one_token_is_not_reused(llama_dir):
    llm = _llm(llama_dir, None)
    llm.generate(TokensPrompt(prompt_token_ids=PREFIX), GREEDY, use_tqdm=False)
    for pos in (0, BS - 1, 2 * BS + 5, 4 * BS + 15):
        changed = list(PREFIX)
        changed[pos] = (changed[pos] + 1) % (VOCAB - 1)
        out = llm.generate(TokensPrompt(prompt_token_ids=changed), GREEDY, use_tqdm=False)[0]
        # the blocks before the change are reused; the changed block and all after it are not
        assert out.num_cached_tokens == max(0, pos // BS * BS - 1)
        ref = _llm(llama_dir, None, enable_prefix_caching=False).generate(
            TokensPrompt(prompt_token_ids=changed), GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_eviction_under_pressure_keeps_every_request_correct(llama_dir, drafters):
    """A cache of 3 blocks for many prefixes: blocks come and go while requests that copied
    theirs run on; every output equals the uncached one."""
    prompts = [_ids(2 * BS + 5, seed=s % 3) + _ids(7, seed=100 + s) for s in range(9)]
    spec = drafters["eagle3"][1]
    ref = _run(_llm(llama_dir, spec, enable_prefix_caching=False), prompts)
    llm = _llm(llama_dir, spec, prefix_caching_max_tokens=3 * BS, max_num_seqs=4)
    out = _run(llm, prompts)
    assert [_summary(o) for o in out] == [_summary(o) for o in ref]
    pc = llm.engine.prefix_cache
    assert len(pc.blocks) <= 3 and llm.get_stats()["prefix_cache_hits"] > 0
    # eviction did happen: the pool filled, and the prefix request 0 stored (3 blocks with its
    # answer) was pushed out by requests 1 and 2 before request 3 came with it again
    assert not pc.free and out[3].num_cached_tokens == 0


def test_seeded_sampling_is_unchanged_by_hits(drafters):
    target, spec = drafters["draft_model"]
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)
    off = _run(_llm(target, spec, enable_prefix_caching=False), TURNS, params)
    on = _run(_llm(target, spec), TURNS, params)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert sum(o.num_cached_tokens for o in on) > 0


def test_reset_and_off(llama_dir):
    llm = _llm(llama_dir, None)
    p = TokensPrompt(prompt_token_ids=PREFIX)
    llm.generate(p, GREEDY, use_tqdm=False)
    assert llm.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens == 5 * BS - 1
    llm.reset_prefix_cache()
    assert llm.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    off = _llm(llama_dir, None, enable_prefix_caching=False)
    off.generate(p, GREEDY, use_tqdm=False)
    assert off.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert "prefix_cache_hits" not in off.get_stats()


def test_a_drafter_that_needs_every_position_turns_caching_off(llama_dir, tmp_path, caplog):
    with caplog.at_level("INFO", logger="specserve"):
        llm = _llm(llama_dir, {"method": "extract_hidden_states",
                               "hidden_states_dir": str(tmp_path)})
    assert llm.engine.prefix_cache is None
    assert "prefix caching off: the extract_hidden_states proposer" in caplog.text


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_budget_is_refused(llama_dir, bad):
    with pytest.raises(ValueError, match="prefix_caching_max_tokens must be >= 1"):
        _llm(llama_dir, None, prefix_caching_max_tokens=bad)


def test_prompt_logprobs_compute_the_whole_prompt(llama_dir):
    """A request asking for its prompt's log-probabilities is never served from the cache,
    and its values equal those of an engine without caching."""
    llm = _llm(llama_dir, None)
    p = TokensPrompt(prompt_token_ids=PREFIX)
    llm.generate(p, GREEDY, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    out = llm.generate(p, params, use_tqdm=False)[0]
    ref = _llm(llama_dir, None, enable_prefix_caching=False).generate(p, params, use_tqdm=False)
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(PREFIX)
    assert out.prompt_logprobs == ref[0].prompt_logprobs
