"""Model-based drafters: synthetic checkpoints in each public format load, and speculation with
them is lossless (greedy output equals no-spec) alone and in mixed batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specserve import LLM, SamplingParams, TokensPrompt
from tests.conftest import DEVICE, make_hf_model

H, V, HEADS, KV, HD, FF = 64, 96, 4, 2, 16, 128     # the tiny llama of conftest


def _rand(*shape, gen):
    return torch.randn(*shape, generator=gen) * 0.2


def _layer(prefix: str, gen, in_dim: int = H, input_norm: bool = True) -> dict:
    t = {f"{prefix}self_attn.q_proj.weight": _rand(HEADS * HD, in_dim, gen=gen),
         f"{prefix}self_attn.k_proj.weight": _rand(KV * HD, in_dim, gen=gen),
         f"{prefix}self_attn.v_proj.weight": _rand(KV * HD, in_dim, gen=gen),
         f"{prefix}self_attn.o_proj.weight": _rand(H, HEADS * HD, gen=gen),
         f"{prefix}mlp.gate_proj.weight": _rand(FF, H, gen=gen),
         f"{prefix}mlp.up_proj.weight": _rand(FF, H, gen=gen),
         f"{prefix}mlp.down_proj.weight": _rand(H, FF, gen=gen),
         f"{prefix}post_attention_layernorm.weight": torch.ones(H)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = torch.ones(H)
    return t


LAYER_CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_attention_heads": HEADS,
             "num_key_value_heads": KV, "intermediate_size": FF, "vocab_size": V,
             "num_hidden_layers": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}


def write(d: Path, cfg: dict, tensors: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    return d


def eagle_ckpt(d: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    t = {"fc.weight": _rand(H, 2 * H, gen=g), "fc.bias": _rand(H, gen=g)}
    t |= _layer("layers.0.", g, input_norm=False)
    return write(d, LAYER_CFG, t)


def eagle3_ckpt(d: Path, draft_vocab: int = 64, vocab: int = V, seed: int = 2) -> Path:
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _rand(H, 3 * H, gen=g), "norm.weight": torch.ones(H),
         "lm_head.weight": _rand(draft_vocab, H, gen=g),
         "d2t": torch.arange(draft_vocab) // 2,     # draft id i -> target id i + i // 2
         "t2d": torch.zeros(vocab, dtype=torch.bool),
         "layers.0.hidden_norm.weight": torch.ones(H)}
    t |= _layer("layers.0.", g, in_dim=2 * H)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "draft_vocab_size": draft_vocab,
           "transformer_layer_config": LAYER_CFG | {"vocab_size": vocab},
           "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    return write(d, cfg, t)


def medusa_ckpt(d: Path, faster_decoding: bool = False, heads: int = 4,
                original_lm_head: bool = False) -> Path:
    g = torch.Generator().manual_seed(3)
    if faster_decoding:
        t = {}
        for i in range(heads):
            t[f"medusa_head.{i}.0.linear.weight"] = _rand(H, H, gen=g)
            t[f"medusa_head.{i}.0.linear.bias"] = _rand(H, gen=g)
            t[f"medusa_head.{i}.1.weight"] = _rand(V, H, gen=g)
        return write(d, {"medusa_num_heads": heads, "medusa_num_layers": 1}, t)
    t = {}
    for i in range(heads):
        t[f"blocks.{i}.layers.0.weight"] = _rand(H, H, gen=g)
        t[f"blocks.{i}.layers.0.bias"] = _rand(H, gen=g)
        if not original_lm_head:        # else every head uses the target's lm_head
            t[f"lm_heads.{i}.weight"] = _rand(V, H, gen=g)
    return write(d, {"architectures": ["MedusaModel"], "num_heads": heads, "num_hidden_layers": 1,
                     "hidden_size": H, "vocab_size": V, "original_lm_head": original_lm_head}, t)


def mlp_speculator_ckpt(d: Path, n_predict: int = 3, inner: int = 48) -> Path:
    g = torch.Generator().manual_seed(4)
    t = {}
    for i in range(n_predict):
        t[f"emb.{i}.weight"] = _rand(V, inner, gen=g)
        t[f"proj.{i}.weight"] = _rand(inner, H if i == 0 else inner, gen=g)
        t[f"head.{i}.weight"] = _rand(V, inner, gen=g)
        t[f"ln.{i}.weight"] = torch.ones(inner)
        t[f"ln.{i}.bias"] = torch.zeros(inner)
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
           "emb_dim": H, "inner_dim": inner, "n_predict": n_predict, "vocab_size": V,
           "tie_weights": False, "scale_input": False}
    return write(d, cfg, t)


def mtp_target(d: Path, layers: int = 1, declared: int | None = None) -> Path:
    """The tiny llama plus `layers` DeepSeek-style MTP layers from index L = 2 (config.json
    says `declared`, by default as many)."""
    make_hf_model("llama", d)
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(5)
    t = load_file(str(d / "model.safetensors"))
    for i in range(layers):
        p = f"model.layers.{2 + i}."
        t |= {p + "enorm.weight": torch.ones(H), p + "hnorm.weight": torch.ones(H),
              p + "eh_proj.weight": _rand(H, 2 * H, gen=g),
              p + "shared_head.norm.weight": torch.ones(H)}
        t |= _layer(p, g)
    save_file(t, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text()) | {
        "num_nextn_predict_layers": declared or layers}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {
        "eagle": ("eagle", eagle_ckpt(root / "eagle-head")),
        "eagle3": ("eagle3", eagle3_ckpt(root / "e3")),
        "medusa": ("medusa", medusa_ckpt(root / "medusa")),
        "medusa_fd": ("medusa", medusa_ckpt(root / "medusa-fd", faster_decoding=True)),
        "medusa_shared": ("medusa", medusa_ckpt(root / "medusa-sh", original_lm_head=True)),
        "mlp_speculator": ("mlp_speculator", mlp_speculator_ckpt(root / "mlp")),
    }


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [TokensPrompt(prompt_token_ids=torch.randint(0, V, (int(torch.randint(3, 30, (1,),
            generator=g)),), generator=g).tolist()) for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa", "medusa_fd", "medusa_shared",
                                  "mlp_speculator"])
def test_head_methods_are_lossless(name, heads, llama_dir):
    method, path = heads[name]
    ps = _prompts(6, seed=7)
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device=DEVICE).generate(
        ps, GREEDY, use_tqdm=False)]
    # No "method": it is inferred from the checkpoint's config or name.
    llm = LLM(str(llama_dir), device=DEVICE, max_num_batched_tokens=32, speculative_config={
        "model": str(path), "num_speculative_tokens": 3})
    assert llm.engine.spec.method == method
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in ps[:2]]
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=10)
    mixed = llm.generate(ps, [GREEDY, sampled] * 3, use_tqdm=False)
    assert alone == ref[:2]
    assert [o.outputs[0].token_ids for o, i in zip(mixed, range(6)) if i % 2 == 0] == ref[::2]
    base = LLM(str(llama_dir), device=DEVICE).generate(ps[1::2], sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[1::2]] == [o.outputs[0].token_ids for o in base]
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0


def greedy_of_several_lengths(llama_dir, seed: int, first: int, step: int):
    """Six prompts, greedy params of max_tokens first, first + step, ..., and the target's
    output for them without speculation."""
    ps = _prompts(6, seed=seed)
    params = [SamplingParams(temperature=0, max_tokens=first + step * i, ignore_eos=True)
              for i in range(6)]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device=DEVICE).generate(
        ps, params, use_tqdm=False)]
    return ps, params, ref


def record_drafts(llm) -> list[list[int]]:
    """The drafts the engine's proposer returns from now on, appended as they come."""
    proposer, record = llm.engine.proposer, []

    def recording(batch, propose=proposer.propose):
        out = propose(batch)
        record.extend(p.token_ids for p in out)
        return out
    proposer.propose = recording
    return record


def test_heads_catch_up_after_speculation_was_off(heads, llama_dir, monkeypatch):
    """While too many requests run, K = 0 and the head holds back the target features; when
    speculation resumes it ingests them in one pass (or every MAX_PENDING positions). The
    head's cache must end up as if it had ingested every step: same drafts, same acceptance."""
    from specserve.methods.head_proposer import HeadProposer
    ps, params, ref = greedy_of_several_lengths(llama_dir, seed=12, first=8, step=6)
    drafts = {}
    for max_pending in (1, 4, 256):         # 1: ingest every step, as without deferral
        monkeypatch.setattr(HeadProposer, "MAX_PENDING", max_pending)
        llm = LLM(str(llama_dir), device=DEVICE, speculative_config={
            "model": str(heads["eagle3"][1]), "num_speculative_tokens": 3,
            "disable_by_batch_size": 3})
        proposer, record = llm.engine.proposer, record_drafts(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        assert got == ref
        assert llm.get_stats()["spec_decode_num_drafts"] > 0   # the last two requests drafted
        assert not proposer.pending                               # nothing left behind
        drafts[max_pending] = record
    assert len(drafts[1]) > 10
    assert drafts[4] == drafts[1] and drafts[256] == drafts[1]


def test_head_acceptance_bookkeeping(tmp_path, llama_dir):
    """With every draft accepted (synthetic rate 1), tau is K + 1 for a head method too."""
    path = medusa_ckpt(tmp_path / "m")
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config={
        "model": str(path), "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rate": 1.0})
    llm.generate(_prompts(2, seed=9), SamplingParams(temperature=0, max_tokens=1 + 4 * 5,
                                                     ignore_eos=True), use_tqdm=False)
    assert llm.get_stats()["mean_acceptance_length"] == 4.0


def test_loaded_weights_match_the_files(heads, llama_dir):
    from safetensors.torch import load_file

    from specserve.methods import load_head
    from specserve.models.loader import load_model
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    # the PyTorch path keeps each weight as read (the kernel's holds only packed copies)
    m = load_head("medusa", str(heads["medusa_fd"][1]), target, torch.device("cpu"),
                  torch.float32, cpu_kernel=False)
    f = load_file(str(heads["medusa_fd"][1] / "model.safetensors"))
    assert torch.equal(m.blocks[2].layers[0].weight, f["medusa_head.2.0.linear.weight"])
    assert torch.equal(m.lm_heads[3].weight, f["medusa_head.3.1.weight"])
    e = load_head("eagle", str(heads["eagle"][1]), target, torch.device("cpu"), torch.float32,
                  cpu_kernel=False)
    f = load_file(str(heads["eagle"][1] / "model.safetensors"))
    qkv = torch.cat([f["layers.0.self_attn.q_proj.weight"], f["layers.0.self_attn.k_proj.weight"],
                     f["layers.0.self_attn.v_proj.weight"]])
    assert torch.equal(e.layers[0].self_attn.qkv_proj.weight, qkv)
    assert e.embed_tokens is target.embed_tokens      # shared when the head has none
    ms = load_head("medusa", str(heads["medusa_shared"][1]), target, torch.device("cpu"),
                   torch.float32, cpu_kernel=False)
    assert all(lm.weight is target.lm_head.weight for lm in ms.lm_heads)
    e3 = load_head("eagle3", str(heads["eagle3"][1]), target, torch.device("cpu"), torch.float32)
    out = torch.randn(2, H)
    logits = e3.logits(out)
    draft_logits = e3.lm_head(e3.norm(out))
    ids = torch.arange(64) + torch.arange(64) // 2
    assert torch.equal(logits[:, ids], draft_logits)
    assert torch.isinf(logits).sum() == 2 * (V - 64)
    assert e3.aux_layers == (0, 1, 1)


@pytest.mark.parametrize("maker, spec, match", [
    (medusa_ckpt, {"num_speculative_tokens": 6},
     "more than the 4 tokens this medusa checkpoint predicts, and not a multiple"),
    (mlp_speculator_ckpt, {"num_speculative_tokens": 5},
     "more than the 3 tokens this mlp_speculator checkpoint predicts"),
    (mlp_speculator_ckpt, {"num_speculative_tokens": 6}, "predicts 3 tokens; set"),
])
def test_k_beyond_the_heads_is_an_error(maker, spec, match, tmp_path, llama_dir):
    path = maker(tmp_path / "h")
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), device=DEVICE, speculative_config={"model": str(path)} | spec)


def test_head_for_another_model_is_refused(tmp_path, llama_dir):
    path = mlp_speculator_ckpt(tmp_path / "mlp")
    cfg = json.loads((path / "config.json").read_text()) | {"vocab_size": 500}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size is 500 but the target's is 96"):
        LLM(str(llama_dir), device=DEVICE, speculative_config={"model": str(path),
                                                                "num_speculative_tokens": 2})


@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp"])
def test_graph_chain_drafts_what_the_loop_drafts(name, heads, llama_dir, tmp_path):
    """The greedy chain HeadChainGraphs captures on CUDA, run eagerly here: six requests padded
    to a batch of 8 through a scratch slot, K the largest per-request budget and each chain cut
    to its own. Its drafts are the PyTorch loop's, and the output stays the target's."""
    from specserve.models.cuda_graphs import HeadChainGraphs
    ps, params, ref = greedy_of_several_lengths(llama_dir, seed=4, first=10, step=4)
    for i, p in enumerate(params):
        p.num_speculative_tokens = 1 + i % 3
    target, spec = llama_dir, {"num_speculative_tokens": 3}
    if name == "mtp":
        target, spec = mtp_target(tmp_path / "mtp"), spec | {"method": "mtp"}
    else:
        spec["model"] = str(heads[name][1])
    drafts = {}
    for graphed in (False, True):
        llm = LLM(str(target), device=DEVICE, cpu_kernel=False, speculative_config=spec)
        proposer = llm.engine.proposer
        assert proposer.chain is None and proposer.graphs is None
        if graphed:
            cache = proposer.cache             # one more slot: the padding rows' scratch
            cache.layers = [(torch.cat([k, torch.zeros_like(k[:1])]),
                             torch.cat([v, torch.zeros_like(v[:1])])) for k, v in cache.layers]
            cache.scratch = cache.num_slots
            proposer.graphs = HeadChainGraphs(proposer.head, cache, 8, capture=False)
        record = record_drafts(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        if name != "mtp":
            assert got == ref
        drafts[graphed] = record
        if graphed:
            assert {key[0] for key in proposer.graphs.graphs} >= {8}     # padded batches ran
    assert sum(map(len, drafts[False])) > 20 and drafts[True] == drafts[False]
