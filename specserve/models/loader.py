"""Load and save models: Hugging Face-format directories (config.json + safetensors) and GGUF
files (`models/gguf.py`).

Pickle checkpoints (`*.bin`, `*.pt`) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specserve.models.gguf import gguf_path, open_gguf
from specserve.models.llama import LlamaArgs
from specserve.models.registry import model_class
from specserve.tokenizer import Tokenizer

_QKV = re.compile(r"^(model\.)?layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(model\.)?layers\.(\d+)\.mlp\.(gate|up)_proj\.weight$")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_hf_config(model_dir: str | Path) -> dict:
    """config.json of a model directory, or its equivalent from a GGUF's metadata."""
    if g := gguf_path(model_dir):
        return open_gguf(g).hf_config
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"model {d} does not exist (give a Hugging Face model directory, "
                                "a .gguf file, a Hub id or a catalogue name: specserve pull "
                                "--list)")
    return read_json(d / "config.json")


def load_tokenizer(model: str | Path) -> Tokenizer | None:
    """The model's tokenizer (tokenizer.json, or a GGUF's metadata); None where it has none."""
    if g := gguf_path(model):
        return Tokenizer.from_parts(*open_gguf(g).tokenizer())
    return Tokenizer(model) if (Path(model) / "tokenizer.json").is_file() else None


def _is_mtp_tensor(name: str, num_layers: int) -> bool:
    """Tensors of multi-token-prediction layers that checkpoints keep beside the target's
    (DeepSeek-V3: layers past the last; MiMo: mtp_layers; Qwen3-Next: mtp.*): the mtp method
    reads them, the target does not."""
    if name.startswith(("mtp.", "mtp_layers.")):
        return True
    m = re.match(r"^layers\.(\d+)\.", name)
    return m is not None and int(m[1]) >= num_layers


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, sharded or not."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise ValueError(
            f"{model_dir} has only pickle weights ({', '.join(pickles)}); specserve does not load "
            "pickle files because they can run code. Convert them to safetensors, e.g. "
            "model.save_pretrained(dir, safe_serialization=True) in transformers.")
    raise FileNotFoundError(f"{model_dir} has no model.safetensors or *.safetensors weights")


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{f} could not be read as safetensors ({e}); the file is corrupt "
                             "or truncated") from e
    return tensors


def fuse_hf_names(hf: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Map HF tensor names onto this project's module names (fused q/k/v and gate/up)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[int, str, str], torch.Tensor] = {}
    for name, t in hf.items():
        if m := _QKV.match(name):
            parts[(int(m[2]), "qkv." + m[4], m[3])] = t
        elif m := _GATE_UP.match(name):
            parts[(int(m[2]), "gate_up.weight", m[3])] = t
        else:
            out[name.removeprefix("model.")] = t
    for i in range(num_layers):
        for kind, order, target in (("qkv.weight", "qkv", "self_attn.qkv_proj.weight"),
                                    ("qkv.bias", "qkv", "self_attn.qkv_proj.bias"),
                                    ("gate_up.weight", ("gate", "up"), "mlp.gate_up_proj.weight")):
            keys = [(i, kind, p) for p in order]
            present = [k in parts for k in keys]
            if any(present):
                if not all(present):
                    missing = [k[2] for k, p in zip(keys, present) if not p]
                    raise ValueError(f"layer {i}: tensors for {missing} ({kind}) are missing")
                out[f"layers.{i}.{target}"] = torch.cat([parts.pop(k) for k in keys], dim=0)
    return out


def split_to_hf_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Inverse of `fuse_hf_names`: the model's tensors under Hugging Face names."""
    a = model.args
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and a.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            for p, part in zip("qkv", t.split([q, kv, kv], dim=0)):
                out["model." + name.replace("qkv_proj", f"{p}_proj")] = part
        elif ".gate_up_proj." in name:
            for p, part in zip(("gate", "up"), t.chunk(2, dim=0)):
                out["model." + name.replace("gate_up_proj", f"{p}_proj")] = part
        elif name == "lm_head.weight":
            out[name] = t
        else:
            out["model." + name] = t
    return {k: v.contiguous() for k, v in out.items()}


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_len: int | None = None) -> torch.nn.Module:
    """Build the model of a local HF directory (safetensors) or GGUF file and load its weights.
    A GGUF's tensors are dequantized one by one straight into `dtype`."""
    g = open_gguf(p) if (p := gguf_path(model_dir)) else None
    d = g.path if g else Path(model_dir)
    source = str(d) if g else str(d / "config.json")
    args = LlamaArgs.from_hf_config(g.hf_config if g else load_hf_config(d), source=source)
    if args.sliding_window is not None and (max_len or args.max_position_embeddings) > args.sliding_window:
        raise ValueError(
            f"{d}: sliding-window attention (window {args.sliding_window}) is not supported; "
            f"pass max_model_len <= {args.sliding_window} so that the window never applies")
    with torch.device("meta"):
        model = model_class(args.architecture)(args, max_len=max_len)
    state = fuse_hf_names(dict(g.tensors(dtype)) if g else read_state_dict(d),
                          args.num_hidden_layers)
    expected = model.state_dict()
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{d}: weights missing from the checkpoint: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    unexpected = sorted(k for k in set(state) - set(expected)
                        if not _is_mtp_tensor(k, args.num_hidden_layers)
                        and not k.endswith("rotary_emb.inv_freq"))     # recomputed, not read
    if unexpected:
        raise ValueError(f"{d}: tensors this {args.architecture} does not have: "
                         f"{', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else "")
                         + "; the checkpoint is of another architecture or variant")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"{d}: tensor {name} has shape {tuple(state[name].shape)}, "
                             f"expected {tuple(t.shape)} from config.json")
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers (rope tables) were built on meta: rebuild them for real.
    model.rotary = type(model.rotary)(args.head_dim, max_len or args.max_position_embeddings,
                                      args.rope_theta, args.rope_scaling)
    return model.to(device=device, dtype=dtype).eval()


def save_model(model: torch.nn.Module, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
               max_shard_bytes: int = 16 * 1024 * 1024) -> None:
    """Write config.json and safetensors shards of at most `max_shard_bytes` each."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in split_to_hf_names(model).items()}
    cfg = model.args.to_hf_config() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for old in d.glob("model*.safetensors*"):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
