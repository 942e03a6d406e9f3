"""LLMEngine.step with a scripted proposer: verified drafts advance a request by accepted + 1
tokens, rejected drafts roll its KV back, and the metrics count both."""

from __future__ import annotations

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.methods.base import Proposal, ProposerBase
from tests.conftest import DEVICE


class Scripted(ProposerBase):
    """Drafts the target's true continuation with one wrong token at position `wrong`."""

    def __init__(self, truth: list[int], prompt_len: int, wrong: int) -> None:
        self.truth, self.prompt_len, self.wrong = truth, prompt_len, wrong

    def propose(self, batch):
        out = []
        for r, k in zip(batch.requests, batch.max_num_tokens):
            done = r.num_tokens - self.prompt_len
            d = self.truth[done:done + k]
            if len(d) > self.wrong:
                d = d[:self.wrong] + [(d[self.wrong] + 1) % 96] + d[self.wrong + 1:]
            out.append(Proposal(d))
        return out


def test_each_step_emits_accepted_plus_one_and_rolls_back_the_rest(llama_dir):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    truth = LLM(str(llama_dir), device=DEVICE).generate(
        TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(llama_dir), device=DEVICE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.engine
    engine.proposer = Scripted(truth, len(prompt), wrong=2)   # d1, d2 right, d3 wrong
    rid = engine.add_request(prompt, params)
    req = engine.requests[rid]
    engine.step()                                  # prefill + first token, then drafts
    assert req.num_tokens == len(prompt) + 1
    assert req.spec_token_ids == truth[1:3] + [(truth[3] + 1) % 96]
    engine.step()                                  # verify: 2 accepted + the target's token
    assert req.output_token_ids == truth[:4]
    assert req.num_computed_tokens == req.num_tokens - 1      # the wrong draft's KV rolled back
    m = engine.get_stats()
    assert (m["spec_decode_num_drafts"], m["spec_decode_num_draft_tokens"],
            m["spec_decode_num_accepted_tokens"]) == (1, 3, 2)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].token_ids == truth and outs[0].finished


def test_a_synthetic_acceptance_length_is_what_the_engine_measures(llama_dir, draft_dir):
    """synthetic_acceptance_length 2.5 at K=3: rates [1, 0.5, 0], so tau = 2.5 on average."""
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config={
        "model": str(draft_dir), "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5})
    prompts = [TokensPrompt(prompt_token_ids=[i + 1, i + 2, i + 3]) for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.get_stats()
    assert stats["spec_decode_num_drafts"] > 100
    per_pos = [a / stats["spec_decode_num_drafts"]
               for a in stats["spec_decode_num_accepted_tokens_per_pos"]]
    assert per_pos[0] > 0.97 and 0.4 < per_pos[1] < 0.6 and per_pos[2] == 0
    assert abs(stats["mean_acceptance_length"] - 2.5) < 0.1
