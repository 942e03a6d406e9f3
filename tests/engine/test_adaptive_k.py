"""Adaptive K: the controller's choices from given timings and acceptance, and that an engine
using it keeps greedy output identical while K changes."""

from __future__ import annotations

import pytest

from specserve import LLM, TokensPrompt
from specserve.engine.adaptive_k import AdaptiveK
from tests.conftest import DEVICE
from tests.test_spec_decode import _greedy, repetitive_prompts, spec_configs


def _timed(ak: AdaptiveK, batch: int, verify_ms: dict[int, float], propose_ms: float) -> None:
    """Give every K two samples: verify_ms[k] plus k * propose_ms."""
    for k, v in verify_ms.items():
        for _ in range(2):
            ak.observe("verify", batch, k, v / 1e3)
            ak.observe("propose", batch, k, k * propose_ms / 1e3)


def _choices(ak: AdaptiveK, n: int, cap: int, verify_s: float, propose_s: float) -> list[int]:
    """n steps at batch 1, each choosing K and timing it as given."""
    picks = []
    for _ in range(n):
        picks.append(ak.choose(1, cap=cap))
        ak.observe("verify", 1, picks[-1], verify_s)
        ak.observe("propose", 1, picks[-1], propose_s)
    return picks


def test_explores_untimed_k_first_largest_then_zero():
    assert _choices(AdaptiveK(4), 10, 4, 1e-3, 1e-3) == [4, 4, 0, 0, 3, 3, 2, 2, 1, 1]


def test_picks_k_with_most_tokens_per_second():
    ak = AdaptiveK(4, prior_acceptance=0.8)
    # Batch 1: a verify row is almost free, drafting cheap -> the largest K pays.
    _timed(ak, 1, {0: 4.0, 1: 4.1, 2: 4.2, 3: 4.3, 4: 4.4}, propose_ms=0.3)
    assert ak.choose(1, cap=4) == 4
    # Batch 8: each draft row costs the target as much as a token -> no speculation.
    _timed(ak, 8, {0: 6.0, 1: 12.0, 2: 18.0, 3: 24.0, 4: 30.0}, propose_ms=1.0)
    assert ak.choose(8, cap=4) == 0
    assert ak.choose(6, cap=4) == 0            # same power-of-two bucket as 8
    # Batch 2: K=1 would gain 2% per step (1.8 tokens for 1.765x the time): below min_gain (5%).
    _timed(ak, 2, {0: 4.0, 1: 7.06, 2: 12.0, 3: 16.0, 4: 20.0}, propose_ms=0.0)
    assert ak.expected_tokens(1) / 7.06 > 1.0 / 4.0 and ak.choose(2, cap=4) == 0
    # With hopeless drafts even cheap steps do not pay.
    for _ in range(400):
        ak.observe_acceptance(4, 0)
    assert ak.accept[0] < 0.05
    assert ak.choose(1, cap=4) == 0
    assert ak.choose(1, cap=0) == 0


def test_acceptance_counts_only_tested_positions():
    ak = AdaptiveK(4, accept_smoothing=0.1, prior_acceptance=0.5)
    ak.observe_acceptance(4, 2)       # drafts 1, 2 accepted, 3 rejected, 4 never tested
    assert ak.accept == [1.0, 1.0, 0.0, 0.5]        # a first observation replaces the prior
    ak.observe_acceptance(4, 0)       # draft 1 rejected: only position 1 tested
    assert ak.accept == [0.5, 1.0, 0.0, 0.5]        # the mean of the first observations
    ak.observe_acceptance(1, 1)       # accepted (the bonus token follows)
    assert ak.accept[0] == pytest.approx(2 / 3)
    assert ak.expected_tokens(0) == 1.0
    assert ak.expected_tokens(2) == pytest.approx(1 + 2 / 3 + 2 / 3 * 1.0)
    for _ in range(100):              # past 1 / smoothing observations: a moving average
        ak.observe_acceptance(1, 0)
    assert ak.accept[0] < 0.01


def test_refresh_retimes_the_stalest_k():
    ak = AdaptiveK(2, refresh_every=5)
    _timed(ak, 1, {0: 4.0, 1: 4.1, 2: 4.2}, propose_ms=0.1)
    picks = _choices(ak, 10, 2, 4e-3, 1e-4)
    assert picks.count(2) >= 8 and set(picks) - {2}      # mostly the best, sometimes another


@pytest.mark.parametrize("method", ["suffix", "draft_model"])
def test_adaptive_k_keeps_greedy_output(method, llama_dir, draft_dir):
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(10, seed=5)]
    ref = LLM(str(llama_dir), device=DEVICE).generate(ps, _greedy(40), use_tqdm=False)
    cfg = spec_configs(draft_dir)[method] | {"adaptive_k": True}
    llm = LLM(str(llama_dir), speculative_config=cfg, device=DEVICE)
    got = llm.generate(ps, _greedy(40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    tried = {k for (_, _, k) in llm.engine.adaptive_k.timings}
    assert tried == set(range(4))                       # explored every K in 0..3
    m = llm.get_stats()
    assert m["spec_decode_num_drafts"] > 0
    assert set(m["adaptive_k_choices"]) == set(range(4))
