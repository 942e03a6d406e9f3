"""Load draft heads from their public checkpoint formats (safetensors only).

- eagle: yuhuili EAGLE-1 (config.json = the head's Llama config; `fc.*`, `layers.0.*`, optional
  `embed_tokens.weight`);
- eagle3: speculators (`speculators_model_type: eagle3`, `transformer_layer_config`,
  `draft_vocab_size`; `fc`, `layers.0.*` with `hidden_norm`, `norm`, `lm_head`, `d2t`) and the
  yuhuili EAGLE-3 layout (`midlayer.*`);
- medusa: vLLM (`blocks.{i}.layers.{j}`, `lm_heads.{i}`; `num_heads`, `num_hidden_layers`) and
  FasterDecoding (`medusa_head.{i}.{j}.linear`, `medusa_head.{i}.{L}`; `medusa_num_heads`, ...);
- mlp_speculator: IBM (`emb.{i}`, `proj.{i}`, `head.{i}`, `ln.{i}`; `n_predict`, `inner_dim`, ...);
- mtp: DeepSeek-style layers `model.layers.{L + i}.*` inside the target checkpoint
  (`num_nextn_predict_layers` in its config.json).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from specserve.models.heads import Eagle3Head, EagleHead, MedusaHeads, MLPSpeculator, MTPLayer
from specserve.models.layers import use_decode_linears
from specserve.models.llama import LlamaArgs
from specserve.models.loader import fuse_hf_names, load_hf_config, read_state_dict


def _assign(module: nn.Module, state: dict[str, torch.Tensor], source: str,
            optional: tuple[str, ...] = ()) -> None:
    """Copy `state` into `module`, naming any missing, unexpected or mis-shaped tensor."""
    own = {k: v for k, v in module.state_dict().items() if not k.startswith(optional)}
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{source}: weights missing from the checkpoint: {', '.join(missing[:8])}")
    for name, t in own.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                             f"expected {tuple(t.shape)}")
    module.load_state_dict({k: state[k] for k in own}, strict=False)


def _head_args(cfg: dict, target: LlamaArgs, source: str) -> LlamaArgs:
    cfg = dict(cfg)
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    if cfg["architectures"][0] not in ("LlamaForCausalLM", "MistralForCausalLM",
                                       "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cfg["architectures"] = ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
        cfg.setdefault(key, getattr(target, key))
    cfg.setdefault("num_hidden_layers", 1)
    return LlamaArgs.from_hf_config(cfg, source=source)


def load_head(method: str, path: str, target: nn.Module, device: torch.device,
              dtype: torch.dtype, cpu_kernel: bool = True) -> nn.Module:
    """The head module of `method` from `path`, ready for inference: sharing the target's
    embedding/lm_head where the checkpoint has none. Vocabulary and width mismatches are load
    errors."""
    head = read_head(method, path, target)
    return use_decode_linears(head.to(device=device, dtype=dtype).eval(), cpu_kernel)


def read_head(method: str, path: str | Path, target: nn.Module) -> nn.Module:
    """The head module of `method` from `path` in float32 on the CPU, as training builds it."""
    loaders = {"eagle": _load_eagle, "eagle3": _load_eagle3, "medusa": _load_medusa,
               "mlp_speculator": _load_mlp_speculator, "mtp": _load_mtp}
    return loaders[method](Path(path), target)


def _embedding(state: dict, target: nn.Module, vocab: int, hidden: int) -> nn.Embedding:
    if "embed_tokens.weight" in state:
        emb = nn.Embedding(vocab, hidden)
        emb.weight.data.copy_(state.pop("embed_tokens.weight"))
        return emb
    return target.embed_tokens


def _check_target(source: str, what: str, head_value: int, target_value: int) -> None:
    if head_value != target_value:
        raise ValueError(f"{source}: the head's {what} is {head_value} but the target's is "
                         f"{target_value}; this head was trained for another model")


def _load_eagle(d: Path, target) -> EagleHead:
    cfg = load_hf_config(d)
    src = str(d / "config.json")
    args = _head_args(cfg, target.args, src)
    _check_target(src, "hidden_size", args.hidden_size, target.args.hidden_size)
    _check_target(src, "vocab_size", args.vocab_size, target.args.vocab_size)
    state = {k.removeprefix("model."): v for k, v in read_state_dict(d).items()}
    emb = _embedding(state, target, args.vocab_size, args.hidden_size)
    head = EagleHead(args, fc_bias="fc.bias" in state, embed=emb, lm_head=target.lm_head)
    _assign(head, fuse_hf_names(state, 1), str(d),
            optional=("embed_tokens.", "lm_head.", "rotary."))
    return head


def _load_eagle3(d: Path, target) -> Eagle3Head:
    cfg = load_hf_config(d)
    src = str(d / "config.json")
    layer_cfg = cfg.get("transformer_layer_config", cfg)
    args = _head_args(layer_cfg, target.args, src)
    _check_target(src, "vocab_size", args.vocab_size, target.args.vocab_size)
    state = {re.sub(r"^midlayer\.", "layers.0.", k.removeprefix("model.")): v
             for k, v in read_state_dict(d).items()}
    state.pop("t2d", None)
    draft_vocab = cfg.get("draft_vocab_size") or args.vocab_size
    target_hidden = cfg.get("target_hidden_size") or target.args.hidden_size
    num_aux = state["fc.weight"].shape[1] // target_hidden if "fc.weight" in state else 3
    emb = _embedding(state, target, args.vocab_size, args.hidden_size)
    head = Eagle3Head(args, num_aux, target_hidden, draft_vocab, target.args.vocab_size, emb)
    _assign(head, fuse_hf_names(state, 1), str(d), optional=("embed_tokens.", "rotary."))
    L = target.args.num_hidden_layers
    head.aux_layers = tuple(cfg.get("eagle_aux_hidden_state_layer_ids") or (2, L // 2, L - 3))
    return head


def _load_medusa(d: Path, target) -> MedusaHeads:
    cfg = load_hf_config(d)
    state = read_state_dict(d)
    if "medusa_num_heads" in cfg:                       # FasterDecoding layout
        n, layers = cfg["medusa_num_heads"], cfg.get("medusa_num_layers", 1)
        renamed = {}
        for k, v in state.items():
            m = re.match(r"medusa_head\.(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$", k)
            if not m:
                continue
            i, j, kind = int(m[1]), int(m[2]), m[3]
            renamed[f"lm_heads.{i}.{kind}" if j == layers else f"blocks.{i}.layers.{j}.{kind}"] = v
        state = renamed
    else:
        n, layers = cfg.get("num_heads", 0), cfg.get("num_hidden_layers", 1)
    if not n:
        raise ValueError(f"{d / 'config.json'}: no Medusa head count (num_heads or "
                         "medusa_num_heads)")
    hidden, vocab = target.args.hidden_size, target.args.vocab_size
    _check_target(str(d), "vocab_size", state["lm_heads.0.weight"].shape[0]
                  if "lm_heads.0.weight" in state else vocab, vocab)
    if not cfg.get("original_lm_head"):
        heads = MedusaHeads(hidden, vocab, n, layers)
        _assign(heads, state, str(d))
        return heads
    shared = target.lm_head                 # a copy in the checkpoint wins, as in vLLM
    if "lm_head.weight" in state:
        _check_target(str(d), "vocab_size", state["lm_head.weight"].shape[0], vocab)
        shared = nn.Linear(hidden, vocab, bias=False)
        shared.weight.data.copy_(state.pop("lm_head.weight"))
    heads = MedusaHeads(hidden, vocab, n, layers, shared_lm_head=shared)
    _assign(heads, state, str(d), optional=("lm_heads.",))
    return heads


def _load_mlp_speculator(d: Path, target) -> MLPSpeculator:
    cfg = load_hf_config(d)
    src = str(d / "config.json")
    for key in ("emb_dim", "inner_dim", "n_predict", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"{src}: required key {key!r} is missing")
    _check_target(src, "emb_dim", cfg["emb_dim"], target.args.hidden_size)
    _check_target(src, "vocab_size", cfg["vocab_size"], target.args.vocab_size)
    inner = cfg["inner_dim"] or cfg["emb_dim"]
    spec = MLPSpeculator(cfg["emb_dim"], inner, cfg["vocab_size"], cfg["n_predict"],
                         bool(cfg.get("tie_weights")), bool(cfg.get("scale_input")))
    _assign(spec, read_state_dict(d), str(d))
    return spec


def _load_mtp(d: Path, target) -> MTPLayer:
    cfg = load_hf_config(d)
    n = cfg.get("num_nextn_predict_layers", 0)
    if not n:
        raise ValueError(f"{d / 'config.json'}: num_nextn_predict_layers is 0 or missing; this "
                         "model has no MTP layer")
    L = target.args.num_hidden_layers
    prefix = f"model.layers.{L}."
    raw = {k[len(prefix):]: v for k, v in read_state_dict(d).items() if k.startswith(prefix)}
    state = {}
    for k, v in raw.items():
        if k.startswith(("enorm.", "hnorm.", "eh_proj.")):
            state[k] = v
        elif k == "shared_head.norm.weight":
            state["shared_head_norm.weight"] = v
        elif k == "shared_head.head.weight":
            state["lm_head.weight"] = v
        elif k == "embed_tokens.weight":
            state[k] = v
        else:
            state["layers.0." + k] = v
    state = {("block." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
             for k, v in fuse_hf_names(state, 1).items()}
    emb = _embedding(state, target, target.args.vocab_size, target.args.hidden_size)
    lm_head = target.lm_head
    if "lm_head.weight" in state:
        lm_head = nn.Linear(target.args.hidden_size, target.args.vocab_size, bias=False)
        lm_head.weight.data.copy_(state.pop("lm_head.weight"))
    layer = MTPLayer(target.args, emb, lm_head)
    _assign(layer, state, str(d), optional=("embed_tokens.", "lm_head.", "rotary."))
    return layer
