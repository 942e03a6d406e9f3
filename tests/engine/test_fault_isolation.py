"""One request's failure aborts that request alone: the others in its batch finish with the
output they have without it, and the engine serves later requests."""

from __future__ import annotations

import pytest
import torch

import specserve.sampling.rejection as rejection
from specserve import LLM, SamplingParams, TokensPrompt
from specserve.engine.engine import LLMEngine
from specserve.methods.base import Proposal
from tests.conftest import DEVICE

BAD_SEED = 666          # marks the request whose work fails


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 90, (n,), generator=g).tolist() for n in (7, 19, 3, 11)]


def _params(seed: int | None = None, temperature: float = 0.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=20, ignore_eos=True)


def _innocent() -> tuple[list[TokensPrompt], list[SamplingParams]]:
    ps = [TokensPrompt(prompt_token_ids=p) for p in _prompts()]
    # greedy requests and a seeded sampled one: each one's output is batch-independent
    return ps, [_params(), _params(), _params(seed=3, temperature=0.8), _params()]


def _inject(stage: str, llm: LLM, monkeypatch) -> None:
    """Make the BAD_SEED request's own work fail at `stage` once it has a few tokens."""
    engine = llm.engine

    def is_bad(req) -> bool:
        return req.params.seed == BAD_SEED and len(req.output_token_ids) >= 3
    if stage == "verification":
        real = rejection._verify_greedy

        def verify_greedy(argmax, r, method, rate):
            if r.params.seed == BAD_SEED and any(is_bad(q) for q in engine.requests.values()
                                                 if q.params is r.params):
                raise RuntimeError("injected verification failure")
            return real(argmax, r, method, rate)
        monkeypatch.setattr(rejection, "_verify_greedy", verify_greedy)
    elif stage == "update":
        real_append = LLMEngine._append_tokens

        def append(self, req, tokens):
            if is_bad(req):
                raise KeyError("injected stop-handling failure")
            return real_append(self, req, tokens)
        monkeypatch.setattr(LLMEngine, "_append_tokens", append)
    elif stage == "proposal":
        real_propose = engine.proposer.propose

        def propose(batch):
            props = real_propose(batch)
            return [Proposal([10**6]) if is_bad(r) else p for r, p in zip(batch.requests, props)]
        monkeypatch.setattr(engine.proposer, "propose", propose)
    else:
        raise AssertionError(stage)


@pytest.mark.parametrize("stage, where", [("verification", "verification"),
                                          ("update", "its update"),
                                          ("proposal", "drafting")])
def test_a_failing_request_is_aborted_alone(llama_dir, draft_dir, monkeypatch, stage, where):
    llm = LLM(str(llama_dir), device=DEVICE, max_num_seqs=8,
              speculative_config={"model": str(draft_dir), "num_speculative_tokens": 3})
    prompts, params = _innocent()
    reference = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["spec_decode_num_drafts"] > 0       # drafts were verified
    _inject(stage, llm, monkeypatch)
    bad = TokensPrompt(prompt_token_ids=_prompts()[1][:5])
    outs = llm.generate(prompts[:2] + [bad] + prompts[2:],
                        params[:2] + [_params(seed=BAD_SEED)] + params[2:], use_tqdm=False)
    failed = outs.pop(2)
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert where in failed.error and len(failed.outputs[0].token_ids) >= 3
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    engine = llm.engine
    assert not engine.requests and not engine.scheduler.running
    assert engine.cache.num_free_slots == engine.cache.num_slots
    again = llm.generate(prompts, params, use_tqdm=False)           # the engine still serves
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in reference]


def test_a_failing_propose_call_fails_its_step_and_the_engine_goes_on(llama_dir, draft_dir,
                                                                       monkeypatch):
    llm = LLM(str(llama_dir), device=DEVICE,
              speculative_config={"model": str(draft_dir), "num_speculative_tokens": 3})
    prompts, params = _innocent()
    reference = llm.generate(prompts, params, use_tqdm=False)
    real = llm.engine.proposer.propose
    calls = {"n": 0}

    def propose(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected proposer failure")
        return real(batch)
    monkeypatch.setattr(llm.engine.proposer, "propose", propose)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" and "proposer.propose" in o.error
               for o in outs)
    assert llm.engine.cache.num_free_slots == llm.engine.cache.num_slots
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in reference]


def test_an_engine_wide_failure_raises_out_of_step(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), device=DEVICE)

    def broken(batch):
        raise RuntimeError("injected target failure")
    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="injected target failure"):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2])], _params(), use_tqdm=False)
