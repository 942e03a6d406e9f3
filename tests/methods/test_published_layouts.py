"""Drafters in their authors' published layouts load and compute what their authors' code
computes (a reference forward written here from their semantics), or are refused by name:
EAGLE-3 with gpt-oss's input_norm, EAGLE 3.1's fc_norm and norm_output, speculators'
norm_before_residual; FasterDecoding Medusa keys; IBM's speculator. prefix; MTP as MiMo and
Qwen3-Next lay it out; a Hub cache detected by its repository name; speculators' own K."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specserve import LLM
from specserve.methods import (
    eagle3,
    medusa,
    mlp_speculator,
    mtp,
    resolve_speculative_config,
)
from specserve.models.loader import load_model
from tests.conftest import DEVICE, make_hf_model
from tests.methods.test_heads import (
    GREEDY,
    HD,
    HEADS,
    KV,
    H,
    V,
    _layer,
    _prompts,
    _rand,
    eagle3_ckpt,
    eagle_ckpt,
    medusa_ckpt,
    mlp_speculator_ckpt,
    write,
)

CPU = torch.device("cpu")


def _norm(n: int, gen) -> torch.Tensor:
    return 1 + 0.3 * torch.randn(n, generator=gen)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half rope of x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]                       # [T, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def ref_layer(t: dict, p: str, attn_in: torch.Tensor, residual: torch.Tensor,
              pos: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """A Llama/Qwen2 decoder layer over one sequence, causal: residual + attention(attn_in),
    then + MLP(post_attention_layernorm(.))."""
    T = attn_in.shape[0]

    def proj(name, n):
        y = attn_in @ t[f"{p}self_attn.{name}_proj.weight"].T
        if bias:
            y = y + t[f"{p}self_attn.{name}_proj.bias"]
        return y.view(T, n, HD)

    q, k, v = rope(proj("q", HEADS), pos), rope(proj("k", KV), pos), proj("v", KV)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / HD ** 0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, HEADS * HD)
    x = residual + att @ t[f"{p}self_attn.o_proj.weight"].T
    m = rms(x, t[f"{p}post_attention_layernorm.weight"])
    gate = F.silu(m @ t[f"{p}mlp.gate_proj.weight"].T) * (m @ t[f"{p}mlp.up_proj.weight"].T)
    return x + gate @ t[f"{p}mlp.down_proj.weight"].T


# --- EAGLE-3 variants ----------------------------------------------------------------------

VARIANTS = {
    "gpt-oss (norm_before_fc)": {"norm_before_fc": True},
    "EAGLE 3.1 (fc_norm, norm_output)": {"fc_norm": True, "norm_output": True},
    "speculators Qwen3 (norm_before_residual)": {"norm_before_residual": True},
    "all": {"norm_before_fc": True, "fc_norm": True, "norm_output": True,
            "norm_before_residual": True},
}


def eagle3_variant(d: Path, flags: dict) -> Path:
    eagle3_ckpt(d, draft_vocab=V)
    t = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    t["norm.weight"] = _norm(H, g)
    t["layers.0.hidden_norm.weight"] = _norm(H, g)
    t["layers.0.input_layernorm.weight"] = _norm(H, g)
    t["d2t"] = torch.zeros(V, dtype=torch.long)
    if flags.get("norm_before_fc"):
        t["input_norm.weight"] = _norm(3 * H, g)
    if flags.get("fc_norm"):
        t |= {f"fc_norm.{i}.weight": _norm(H, g) for i in range(3)}
    save_file(t, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text()) | flags | {"draft_vocab_size": V}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def ref_eagle3(t: dict, flags: dict, emb: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor):
    """(state fed to the next step, draft logits) as the authors' heads compute them."""
    if flags.get("norm_before_fc"):
        aux = rms(aux, t["input_norm.weight"])
    if flags.get("fc_norm"):
        aux = torch.cat([rms(a, t[f"fc_norm.{i}.weight"]) for i, a in enumerate(aux.chunk(3, -1))],
                        -1)
    fused = aux @ t["fc.weight"].T
    hn = rms(fused, t["layers.0.hidden_norm.weight"])
    x = torch.cat([rms(emb, t["layers.0.input_layernorm.weight"]), hn], -1)
    out = ref_layer(t, "layers.0.", x, hn if flags.get("norm_before_residual") else fused, pos)
    normed = rms(out, t["norm.weight"])
    return (normed if flags.get("norm_output") else out), normed @ t["lm_head.weight"].T


@pytest.mark.parametrize("variant", VARIANTS)
def test_eagle3_variants_compute_what_their_authors_do(variant, tmp_path, llama_dir):
    flags = VARIANTS[variant]
    d = eagle3_variant(tmp_path / "e3", flags)
    target = load_model(llama_dir, torch.float32, CPU)
    head = eagle3.read(d, target)
    t = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    tokens, aux = torch.randint(0, V, (12,), generator=g), torch.randn(12, 3 * H, generator=g)
    pos = torch.arange(12)
    with torch.no_grad():
        out = head(tokens[None], head.fuse_target(aux)[None], pos[None], None, None)[0]
        logits = head.draft_logits(out)
        ref_out, ref_logits = ref_eagle3(t, flags, target.embed_tokens.weight[tokens], aux, pos)
    assert (out - ref_out).abs().max() < 1e-4
    assert (logits - ref_logits).abs().max() < 1e-4
    assert (head.chain_parts() is None) == bool(flags.get("norm_output")
                                                or flags.get("norm_before_residual"))


def test_eagle3_variant_is_lossless_in_the_engine(tmp_path, llama_dir):
    d = eagle3_variant(tmp_path / "e3-all", VARIANTS["all"])
    ps = _prompts(4, seed=3)
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device=DEVICE).generate(
        ps, GREEDY, use_tqdm=False)]
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config={
        "method": "eagle3", "model": str(d), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == ref


def test_eagle3_unknown_flag_and_unexpected_tensor_are_refused(tmp_path, llama_dir):
    target = load_model(llama_dir, torch.float32, CPU)
    d = eagle3_variant(tmp_path / "flag", {})
    cfg = json.loads((d / "config.json").read_text()) | {"norm_after_fc": True}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="EAGLE-3 flag norm_after_fc=true is not supported"):
        eagle3.read(d, target)
    # a norm's tensor without its flag: never dropped
    d = eagle3_variant(tmp_path / "tensor", {})
    t = load_file(str(d / "model.safetensors")) | {"input_norm.weight": torch.ones(3 * H)}
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="tensors this format does not have.*input_norm.weight"):
        eagle3.read(d, target)


def test_speculators_k_is_the_default(tmp_path, llama_dir):
    d = eagle3_ckpt(tmp_path / "spec-e3")
    cfg = json.loads((d / "config.json").read_text()) | {"speculators_config": {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}]}}
    (d / "config.json").write_text(json.dumps(cfg))
    assert resolve_speculative_config({"model": str(d)}).num_speculative_tokens == 5
    # the head drafts from its own output: a larger K is allowed
    assert resolve_speculative_config({"model": str(d), "num_speculative_tokens": 7}
                                      ).num_speculative_tokens == 7


# --- Medusa, MLP speculator ------------------------------------------------------------------

def test_faster_decoding_medusa_keys_load_as_written(tmp_path, llama_dir):
    """medusa_lm_head.pt's keys ({i}.{j}.linear.*, {i}.{L}.weight), saved as safetensors."""
    src = medusa_ckpt(tmp_path / "prefixed", faster_decoding=True)
    t = {k.removeprefix("medusa_head."): v
         for k, v in load_file(str(src / "model.safetensors")).items()}
    d = write(tmp_path / "medusa_lm_head", {"medusa_num_heads": 4, "medusa_num_layers": 1}, t)
    target = load_model(llama_dir, torch.float32, CPU)
    heads = medusa.read(d, target)
    h = torch.randn(5, H, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = heads(h)                                                   # [5, 4, V]
    for i in range(4):
        x = h + F.silu(h @ t[f"{i}.0.linear.weight"].T + t[f"{i}.0.linear.bias"])
        assert (got[:, i] - x @ t[f"{i}.1.weight"].T).abs().max() < 1e-4
    t["extra.weight"] = torch.zeros(2)
    write(d, {"medusa_num_heads": 4, "medusa_num_layers": 1}, t)
    with pytest.raises(ValueError, match="tensor 'extra.weight' is not part of the FasterDecoding"):
        medusa.read(d, target)


def test_ibm_speculator_prefix_loads(tmp_path, llama_dir):
    plain = mlp_speculator_ckpt(tmp_path / "plain")
    t = {"speculator." + k: v for k, v in load_file(str(plain / "model.safetensors")).items()}
    d = write(tmp_path / "prefixed", json.loads((plain / "config.json").read_text()), t)
    target = load_model(llama_dir, torch.float32, CPU)
    a, b = mlp_speculator.read(plain, target), mlp_speculator.read(d, target)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# --- MTP as MiMo and Qwen3-Next lay it out ----------------------------------------------------

def _mtp_parts(g) -> dict:
    return {"e": _norm(H, g), "h": _norm(H, g), "proj": _rand(H, 2 * H, gen=g),
            "final": _norm(H, g)}


def mimo_target(d: Path) -> tuple[Path, dict]:
    """A tiny Qwen2 saved as MiMoForCausalLM with one MTP layer under model.mtp_layers.0."""
    make_hf_model("qwen2", d)
    t = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    parts = _mtp_parts(g)
    p = "model.mtp_layers.0."
    t |= {p + "token_layernorm.weight": parts["e"], p + "hidden_layernorm.weight": parts["h"],
          p + "input_proj.weight": parts["proj"], p + "final_layernorm.weight": parts["final"]}
    layer = _layer(p, g)
    layer |= {p + f"self_attn.{n}_proj.bias": _rand(s, gen=g)
              for n, s in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD))}
    t |= layer
    save_file(t, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text()) | {
        "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_nextn_predict_layers": 1}
    (d / "config.json").write_text(json.dumps(cfg))
    return d, t


def test_mimo_mtp_computes_what_mimo_does(tmp_path):
    d, t = mimo_target(tmp_path / "mimo")
    target = load_model(d, torch.float32, CPU)
    assert target.args.attention_bias          # a Qwen2 model
    layer = mtp.read(d, target)
    g = torch.Generator().manual_seed(0)
    tokens, h, pos = torch.randint(0, V, (10,), generator=g), torch.randn(10, H, generator=g), \
        torch.arange(10)
    p = "model.mtp_layers.0."
    with torch.no_grad():
        out = layer(tokens[None], h[None], pos[None], None, None)[0]
        logits = layer.logits(out)
        emb = target.embed_tokens.weight[tokens]
        # MiMo: input_proj over [hidden_layernorm(h); token_layernorm(embedding)]
        x = torch.cat([rms(h, t[p + "hidden_layernorm.weight"]),
                       rms(emb, t[p + "token_layernorm.weight"])], -1)
        x = x @ t[p + "input_proj.weight"].T
        ref = ref_layer(t, p, rms(x, t[p + "input_layernorm.weight"]), x, pos, bias=True)
        ref_logits = rms(ref, t[p + "final_layernorm.weight"]) @ target.lm_head.weight.T
    assert (logits - ref_logits).abs().max() < 1e-4


def test_mimo_target_speculates_with_its_own_mtp_layer(tmp_path):
    d, _ = mimo_target(tmp_path / "mimo")
    ps = _prompts(3, seed=4)
    ref = [o.outputs[0].token_ids for o in LLM(str(d), device=DEVICE).generate(
        ps, GREEDY, use_tqdm=False)]
    llm = LLM(str(d), device=DEVICE, speculative_config={"method": "mtp"})
    assert llm.engine.spec.num_speculative_tokens == 1
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == ref


def qwen3_next_mtp(d: Path, layers: int = 1) -> tuple[Path, dict]:
    """A tiny Qwen3 with Qwen3-Next's mtp.* module beside it."""
    make_hf_model("qwen3", d, head_dim=HD)
    t = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(12)
    parts = _mtp_parts(g)
    t |= {"mtp.pre_fc_norm_embedding.weight": parts["e"],
          "mtp.pre_fc_norm_hidden.weight": parts["h"], "mtp.fc.weight": parts["proj"],
          "mtp.norm.weight": parts["final"]}
    for i in range(layers):
        t |= _layer(f"mtp.layers.{i}.", g)
        t |= {f"mtp.layers.{i}.self_attn.q_norm.weight": _norm(HD, g),
              f"mtp.layers.{i}.self_attn.k_norm.weight": _norm(HD, g)}
    save_file(t, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text()) | {"mtp_num_hidden_layers": layers}
    (d / "config.json").write_text(json.dumps(cfg))
    return d, t


def test_qwen3_next_mtp_layout_loads_on_a_qwen3_target(tmp_path):
    d, t = qwen3_next_mtp(tmp_path / "q3")
    target = load_model(d, torch.float32, CPU)
    layer = mtp.read(d, target)
    assert torch.equal(layer.eh_proj.weight, t["mtp.fc.weight"])       # [embedding; hidden]
    assert torch.equal(layer.enorm.weight, t["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(layer.hnorm.weight, t["mtp.pre_fc_norm_hidden.weight"])
    assert torch.equal(layer.shared_head_norm.weight, t["mtp.norm.weight"])
    assert torch.equal(layer.block.self_attn.q_norm.weight,
                       t["mtp.layers.0.self_attn.q_norm.weight"])
    assert resolve_speculative_config({"method": "mtp"}, str(d)).num_speculative_tokens == 1
    d2, _ = qwen3_next_mtp(tmp_path / "q3-two", layers=2)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=2: a Qwen3-Next MTP module"):
        mtp.read(d2, load_model(d2, torch.float32, CPU))


# --- the Hub cache ---------------------------------------------------------------------------

def test_hub_cache_is_resolved_offline_and_detected_by_repository_name(tmp_path, monkeypatch,
                                                                       llama_dir):
    """An EAGLE-1 head's config is a plain LlamaConfig: only its name says what it is, and in a
    Hub cache the directory is named by a commit hash."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--someone--tiny-EAGLE-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    eagle_ckpt(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    cfg = resolve_speculative_config({"model": "someone/tiny-EAGLE-llama",
                                      "num_speculative_tokens": 2})
    assert cfg.method == "eagle" and cfg.model.endswith(commit)
    assert resolve_speculative_config({"model": cfg.model, "num_speculative_tokens": 2}
                                      ).method == "eagle"
    with pytest.raises(FileNotFoundError, match="someone/absent is not in the Hugging Face cache"):
        resolve_speculative_config({"model": "someone/absent", "num_speculative_tokens": 2})
    # a target by Hub id, too
    target_repo = tmp_path / "hub" / "models--someone--tiny-llama"
    shutil.copytree(llama_dir, target_repo / "snapshots" / commit)
    (target_repo / "refs").mkdir()
    (target_repo / "refs" / "main").write_text(commit)
    assert LLM("someone/tiny-llama", device=DEVICE).engine.vocab_size == V

