"""MTP: layers inside the target's checkpoint (DeepSeek's format) draft in turn, losslessly."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tests.conftest import DEVICE
from tests.methods.test_heads import GREEDY, _prompts, mtp_target


def test_mtp_is_lossless_and_loads_from_the_target(tmp_path, llama_dir):
    target = mtp_target(tmp_path / "mtp")
    ps = _prompts(4, seed=8)
    ref = [o.outputs[0].token_ids for o in LLM(str(target), device=DEVICE).generate(
        ps, GREEDY, use_tqdm=False)]
    llm = LLM(str(target), device=DEVICE, speculative_config={"method": "mtp",
                                                               "num_speculative_tokens": 2})
    got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert got == ref and llm.get_stats()["spec_decode_num_drafts"] > 0
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=16)         # seeded: equal too
    assert ([o.outputs[0].token_ids for o in llm.generate(ps, sampled, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in LLM(str(target), device=DEVICE).generate(
                ps, sampled, use_tqdm=False)])
    with pytest.raises(ValueError, match="no MTP layer: num_nextn_predict_layers"):
        LLM(str(llama_dir), device=DEVICE, speculative_config={"method": "mtp",
                                                                "num_speculative_tokens": 2})


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 2}, {"num_speculative_tokens": 4},
                                  {"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"}])
def test_mtp_with_several_layers_uses_them_in_turn(tmp_path, spec):
    """Two MTP layers: K defaults to 2, step i runs layer i mod 2 with its own KV cache (K = 4
    cycles them; a tree runs one per level), and the output is the target's."""
    from specserve.methods.mtp import MTPStack
    target = mtp_target(tmp_path / "mtp2", layers=2)
    ps = _prompts(4, seed=8)
    ref = [o.outputs[0].token_ids for o in LLM(str(target), device=DEVICE).generate(
        ps, GREEDY, use_tqdm=False)]
    llm = LLM(str(target), device=DEVICE, speculative_config={"method": "mtp"} | spec)
    proposer = llm.engine.proposer
    assert isinstance(proposer.head, MTPStack) and len(proposer.cache.layers) == 2
    if "num_speculative_tokens" not in spec:
        assert llm.engine.spec.num_speculative_tokens == 4          # the tree's nodes
    calls = [0, 0]
    for i, layer in enumerate(proposer.head.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert got == ref and llm.get_stats()["spec_decode_num_drafts"] > 0
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=16)         # seeded: equal too
    assert ([o.outputs[0].token_ids for o in llm.generate(ps, sampled, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in LLM(str(target), device=DEVICE).generate(
                ps, sampled, use_tqdm=False)])
    assert calls[0] > 0 and calls[1] > 0
    eh = [layer.eh_proj for layer in proposer.head.layers]
    # a packed linear has no .weight
    w0, w1 = (m.weight if m.weight is not None else m.kernel_weight for m in eh)
    assert w0.data_ptr() != w1.data_ptr()


def test_mtp_default_k_is_its_layer_count_and_a_missing_layer_is_named(tmp_path):
    target = mtp_target(tmp_path / "mtp2", layers=2)
    assert LLM(str(target), device=DEVICE, speculative_config={
        "method": "mtp"}).engine.spec.num_speculative_tokens == 2
    short = mtp_target(tmp_path / "mtp-short", layers=1, declared=2)
    with pytest.raises(ValueError, match=r"MTP layer model\.layers\.3\.\* that the checkpoint"):
        LLM(str(short), device=DEVICE, speculative_config={"method": "mtp"})
