"""Reading and writing the public head formats: helpers every head method shares."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specserve.models.llama import LlamaArgs
from specserve.models.loader import load_hf_config


def assign_weights(module: nn.Module, state: dict[str, torch.Tensor], source: str,
                   optional: tuple[str, ...] = ()) -> None:
    """Copy `state` into `module`, naming any missing, unexpected or mis-shaped tensor."""
    own = {k: v for k, v in module.state_dict().items() if not k.startswith(optional)}
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{source}: weights missing from the checkpoint: {', '.join(missing[:8])}")
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"{source}: tensors this format does not have, which specserve would "
                         f"otherwise ignore: {', '.join(unexpected[:8])}"
                         + (" ..." if len(unexpected) > 8 else "")
                         + "; the checkpoint is a variant specserve does not read")
    for name, t in own.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                             f"expected {tuple(t.shape)}")
    module.load_state_dict({k: state[k] for k in own}, strict=False)


def speculators_k(path: str) -> int | None:
    """K a speculators checkpoint was trained for: its default proposal method's
    speculative_tokens (the first method's when none is named); None where it names none."""
    sc = load_hf_config(path).get("speculators_config") or {}
    proposals = [p for p in sc.get("proposal_methods") or [] if isinstance(p, dict)]
    chosen = [p for p in proposals if p.get("proposal_type") == sc.get("default_proposal_method")]
    k = (chosen or proposals or [{}])[0].get("speculative_tokens")
    return k if isinstance(k, int) and k > 0 else None


def head_args(cfg: dict, target: LlamaArgs, source: str) -> LlamaArgs:
    cfg = dict(cfg)
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    if cfg["architectures"][0] not in ("LlamaForCausalLM", "MistralForCausalLM",
                                       "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cfg["architectures"] = ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
        cfg.setdefault(key, getattr(target, key))
    cfg.setdefault("num_hidden_layers", 1)
    return LlamaArgs.from_hf_config(cfg, source=source)


def embedding_of(state: dict, target: nn.Module, vocab: int, hidden: int) -> nn.Embedding:
    if "embed_tokens.weight" in state:
        emb = nn.Embedding(vocab, hidden)
        emb.weight.data.copy_(state.pop("embed_tokens.weight"))
        return emb
    return target.embed_tokens


def check_target(source: str, what: str, head_value: int, target_value: int) -> None:
    if head_value != target_value:
        raise ValueError(f"{source}: the head's {what} is {head_value} but the target's is "
                         f"{target_value}; this head was trained for another model")


def layer_args(target: LlamaArgs) -> LlamaArgs:
    """A head's decoder layer has the target's width and attention shape."""
    a = LlamaArgs(**{k: getattr(target, k) for k in target.__dataclass_fields__})
    a.num_hidden_layers = 1
    return a


def to_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in tensors.items()}


def layer_tensors(layer: nn.Module, a: LlamaArgs, prefix: str) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors under HF names (q/k/v and gate/up split)."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    out = {}
    for name, t in layer.state_dict().items():
        if ".qkv_proj." in name:
            for p, part in zip("qkv", t.split([q, kv, kv], dim=0)):
                out[prefix + name.replace("qkv_proj", f"{p}_proj")] = part
        elif ".gate_up_proj." in name:
            for p, part in zip(("gate", "up"), t.chunk(2, dim=0)):
                out[prefix + name.replace("gate_up_proj", f"{p}_proj")] = part
        else:
            out[prefix + name] = t
    return out


def add_shard(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to a model directory as an extra safetensors shard (index updated)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        single = model_dir / "model.safetensors"
        with safe_open(str(single), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: single.name for k in f.keys()}}
    name = "model-mtp.safetensors"
    save_file(tensors, str(model_dir / name), metadata={"format": "pt"})
    index["weight_map"].update({k: name for k in tensors})
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def write_head(out: Path, cfg: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """A head directory: config.json and one model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_dtype(tensors, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")



