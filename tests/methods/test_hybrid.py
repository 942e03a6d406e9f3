"""hybrid_prompt_lookup: requests whose last N tokens occurred earlier draft by prompt lookup,
the others by the model-based drafter, and greedy output stays the target's."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams, TokensPrompt
from tests.conftest import DEVICE
from tests.methods.test_heads import eagle3_ckpt
from tests.test_spec_decode import repetitive_prompts


def _drafter_drafts(llm) -> dict[tuple[str, int], list[int]]:
    """(request id, tokens so far) -> the drafter's draft, recorded from now on (under the key
    None: the number of steps it drafted for no request); the drafter sits under the hybrid
    proposer when there is one."""
    proposer = llm.engine.proposer
    drafter = getattr(proposer, "drafter", proposer)
    record = {None: 0}

    def recording(batch, propose=drafter.propose):
        out = propose(batch)
        record[None] += not batch.requests
        for r, p in zip(batch.requests, out):
            record[(r.request_id, r.num_tokens)] = p.token_ids
        return out
    drafter.propose = recording
    return record


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_hybrid_is_lossless_and_leaves_the_drafter_in_step(method, llama_dir, draft_dir,
                                                           tmp_path):
    """Repeating prompts alone and in a batch: greedy output equals no-spec; lookup and the
    drafter both draft, and some steps are lookup's alone; and wherever both runs asked the
    drafter at the same point of a request, it drafted the same tokens: skipping its drafts
    for lookup steps left its state (a head's ingested features, a draft model's cache) as if
    it had drafted every step."""
    model = str(eagle3_ckpt(tmp_path / "e3")) if method == "eagle3" else str(draft_dir)
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(8, seed=4)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True)
              for i in range(8)]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device=DEVICE).generate(
        ps, params, use_tqdm=False)]
    spec = {"method": method, "model": model, "num_speculative_tokens": 3}
    drafts = {}
    for extra in ({}, {"hybrid_prompt_lookup": 2}):
        llm = LLM(str(llama_dir), device=DEVICE, max_num_seqs=4,
                  speculative_config=spec | extra)
        record = _drafter_drafts(llm)
        alone = [llm.generate(p, q, use_tqdm=False)[0].outputs[0].token_ids
                 for p, q in zip(ps[:2], params)]
        got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        assert alone == ref[:2] and got == ref
        idle = record.pop(None)
        first = min(int(rid) for rid, _ in record)      # request ids count on across LLMs
        drafts[bool(extra)] = {(int(rid) - first, n): d for (rid, n), d in record.items()}
        if extra:
            assert llm.engine.proposer.num_lookup_drafts > 10 and idle > 3
    plain, hybrid = drafts[False], drafts[True]
    shared = plain.keys() & hybrid.keys()
    assert len(hybrid) < len(plain) and len(shared) > 10
    assert all(plain[key] == hybrid[key] for key in shared)


@pytest.mark.parametrize("spec, match", [
    ({"method": "suffix", "hybrid_prompt_lookup": 3}, "not to 'suffix'"),
    ({"method": "ngram", "hybrid_prompt_lookup": 3}, "use method 'ngram'"),
    ({"method": "draft_model", "model": "d", "hybrid_prompt_lookup": 0}, "int >= 1"),
    ({"method": "draft_model", "model": "d", "hybrid_prompt_lookup": True}, "int >= 1")])
def test_hybrid_config_errors(spec, match):
    from specserve.methods import resolve_speculative_config
    with pytest.raises(ValueError, match=match):
        resolve_speculative_config(spec | {"num_speculative_tokens": 2})
