"""DFlash: a block drafter fed the target's hidden states. Lossless (greedy equality at K = 4,
8, 15, alone and batched; the sampled distribution), its block attends non-causally and reads
the injected context, its checkpoint format round-trips, and a wrong target is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve import LLM, TokensPrompt
from specserve.kernels.cpu import load_library
from specserve.methods import dflash, resolve_speculative_config
from specserve.models.loader import load_model
from tests.conftest import DEVICE
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


def make_dflash(target_dir: Path, out: Path, block_size: int = 16, num_layers: int = 2,
                mask: int = 93, seed: int = 0) -> Path:
    """A random drafter for the target in `target_dir`, written in the z-lab format."""
    torch.manual_seed(seed)
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    counts = np.ones(target.args.vocab_size, dtype=np.int64)
    counts[mask] = 0
    drafter = dflash.new_head(target, block_size - 1, None, counts, block_size=block_size,
                              num_layers=num_layers)
    with torch.no_grad():                     # peaked, input-dependent drafts
        for name, p in drafter.named_parameters():
            if p.dim() >= 2 and not name.startswith(("embed_tokens", "lm_head")):
                p.normal_(0, 0.15)
    dflash.write(drafter, out, target_dir, torch.float32)
    return out


@pytest.fixture(scope="module")
def dflash_dir(llama_dir, tmp_path_factory):
    return make_dflash(llama_dir, tmp_path_factory.mktemp("dflash") / "d")


def _spec(path, k: int | None = None, **kw) -> dict:
    return {"method": "dflash", "model": str(path)} | (
        {} if k is None else {"num_speculative_tokens": k}) | kw


@pytest.mark.parametrize("k", [4, 8, 15])
def test_greedy_output_is_the_targets_alone_and_in_mixed_batches(llama_dir, dflash_dir, k):
    m = assert_lossless_alone_and_mixed(llama_dir, _spec(dflash_dir, k))
    assert m["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("extra", [{"disable_by_batch_size": 3}, {"adaptive_k": True}],
                         ids=["disable_by_batch_size", "adaptive_k"])
def test_drafting_paused_or_shortened_keeps_output(llama_dir, dflash_dir, extra):
    """Steps without drafts still write the context, so drafting resumes on a whole one."""
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(6, seed=11)]
    sps = [_greedy(16 + 8 * i) for i in range(6)]       # requests end one by one
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device=DEVICE).generate(
        ps, sps, use_tqdm=False)]
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(dflash_dir, 4, **extra))
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sps, use_tqdm=False)] == ref
    assert llm.get_stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("rejection, draft_sample", [("strict", "greedy"),
                                                     ("probabilistic", "probabilistic")])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path,  # noqa: F811
                                                 rejection, draft_sample):
    target, _ = small_vocab_pair
    d = make_dflash(target, tmp_path / "dfl", block_size=4, mask=6, seed=2)
    llm = LLM(str(target), device=DEVICE, max_num_seqs=64, max_num_batched_tokens=512,
              speculative_config=_spec(d, 2, rejection_sample_method=rejection,
                                       draft_sample_method=draft_sample))
    exact = _exact_pair_distribution(target)
    tv = 0.5 * (_token_hist(llm, N_SAMPLES, 300_000) - exact).abs().sum().item()
    rate = llm.get_stats()["acceptance_rate"]
    assert 0.02 < rate < 0.95                                  # accepts and rejections both
    assert tv < TV_BOUND, f"total variation {tv:.3f} from the target's exact distribution"


def _dense_drafts(drafter, target, ids: list[int], k: int, causal: bool = False,
                  no_context: bool = False) -> list[int]:
    """The drafts of a dense pass: context = the target's features of ids[:-1], the block
    [ids[-1], mask x k] seeing all of it and (unless `causal`) its whole self."""
    q = len(ids) - 1
    with torch.inference_mode():
        x = torch.tensor([ids[:-1]])
        pos = torch.arange(q)[None]
        _, aux = target(x, pos, aux_layers=drafter.aux_layers)
        blocks = torch.tensor([[ids[-1]] + [drafter.mask_token_id] * k])
        mask = torch.ones(k + 1, q + k + 1, dtype=torch.bool)
        if causal:
            mask[:, q:] = torch.ones(k + 1, k + 1, dtype=torch.bool).tril()
        if no_context:
            mask[:, :q] = False
        out = drafter(blocks, torch.arange(q, q + k + 1)[None], drafter.context(aux), pos,
                      mask[None, None])
        return drafter.logits(out[0, 1:]).argmax(-1).tolist()


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "layer-by-layer"])
def test_each_step_drafts_what_a_dense_non_causal_pass_over_the_context_gives(llama_dir,
                                                                             dflash_dir,
                                                                             one_call):
    """Every proposal (cached context written step by step, one pass for the whole block, on
    the CPU kernel in one call each or layer by layer) equals the dense formula; the same drafts
    with a causal block or without the injected context differ, so the block really attends
    both ways and reads the context."""
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(dflash_dir, 6))
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    drafter = dflash.read(dflash_dir, target)
    proposer = llm.engine.proposer
    if not one_call:
        proposer.forward = proposer.write_kv = None
    elif DEVICE == "cpu" and load_library() is not None:
        assert proposer.forward is not None and proposer.write_kv is not None
    propose, seen = proposer.propose, {"checked": 0, "causal": 0, "context": 0}

    def checked(batch):
        out = propose(batch)
        for r, p, k in zip(batch.requests, out, batch.max_num_tokens):
            ids = list(r.all_token_ids)
            assert p.token_ids == _dense_drafts(drafter, target, ids, k)
            seen["checked"] += 1
            seen["causal"] += p.token_ids != _dense_drafts(drafter, target, ids, k, causal=True)
            seen["context"] += p.token_ids != _dense_drafts(drafter, target, ids, k,
                                                            no_context=True)
        return out

    proposer.propose = checked
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(3, seed=6)]
    llm.generate(ps, _greedy(24), use_tqdm=False)
    assert seen["checked"] > 10
    assert seen["causal"] > seen["checked"] // 2 and seen["context"] > seen["checked"] // 2


def test_the_training_layout_is_what_inference_sees(llama_dir, dflash_dir):
    """The loss's blocks (several anchors in one pass, each seeing the context before it and
    its own rows only) give each anchor's dense single-block output."""
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    drafter = dflash.read(dflash_dir, target)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 90, (1, 40), generator=g)
    pos = torch.arange(40)[None]
    seen = []
    real_forward = drafter.forward
    drafter.forward = lambda *a: seen.append(a) or real_forward(*a)
    with torch.no_grad():
        h, aux = target(x, pos, aux_layers=drafter.aux_layers)
        logp = torch.log_softmax(target.compute_logits(h), -1)
        dflash.loss(drafter, x, pos, h, aux, logp, 15,
                    lambda lg, lp: (lg.log_softmax(-1).exp() * 0).sum())
        blocks, block_pos, ctx, ctx_pos, mask = seen[0]
        out = real_forward(blocks, block_pos, ctx, ctx_pos, mask)[0]
        B = drafter.block_size
        for a in range(blocks.shape[1] // B):
            anchor = int(block_pos[0, a * B])
            ids = x[0, :anchor + 1].tolist()
            want = _dense_drafts(drafter, target, ids, B - 1)
            got = drafter.logits(out[a * B + 1:(a + 1) * B]).argmax(-1).tolist()
            assert got == want


def test_k_defaults_from_the_block_and_may_not_pass_it(llama_dir, dflash_dir):
    cfg = resolve_speculative_config({"model": str(dflash_dir)}, str(llama_dir))
    assert (cfg.method, cfg.num_speculative_tokens, cfg.parallel_drafting) == ("dflash", 15, True)
    with pytest.raises(ValueError, match="more than the 15 tokens"):
        resolve_speculative_config(_spec(dflash_dir, 16), str(llama_dir))


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key == "dflash_config":
            cfg["dflash_config"] = cfg["dflash_config"] | value
        elif value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 96}, "hidden_size is 96 but the target's is 64"),
    ({"num_target_layers": 36}, "number of target layers is 36 but the target's is 2"),
    ({"dflash_config": {"target_layer_ids": [1]}}, r"target_layer_ids \[1\] must lie in 0..0"),
    ({"dflash_config": {"target_layer_ids": [0]}}, "fc reads 128 features, but 1 target"),
    ({"dflash_config": {"mask_token_id": None}}, "names no mask token"),
    ({"block_size": None}, "needs block_size"),
])
def test_a_drafter_for_another_target_is_refused(llama_dir, dflash_dir, tmp_path, changes,
                                                  message):
    bad = _edit_config(dflash_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(bad, 4))


def test_the_checkpoint_is_the_z_lab_layout(llama_dir, dflash_dir):
    from safetensors import safe_open
    cfg = json.loads((dflash_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    with safe_open(str(dflash_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.self_attn.q_norm.weight", "layers.1.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    assert dflash.read(dflash_dir, target).embed_tokens is target.embed_tokens   # shared


def test_fusing_the_context_projection_leaves_plain_weights(llama_dir, dflash_dir):
    """The fused k/v projection is a copy of the layers' weights, not a node of an autograd
    graph over them (which made every later .to() warn and kept the graph alive)."""
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    drafter = dflash.read(dflash_dir, target)
    drafter.fuse_context_kv()
    assert drafter.kv_proj.weight.is_leaf and not drafter.kv_proj.weight.requires_grad
    assert all(p.is_leaf for p in drafter.parameters())
