"""Random-weight models of real shapes, for benchmarks of the regime speculation is for.

A step of a 0.5B-8B model reads more weight bytes than any cache holds, so a verify step of a
few rows costs about what a one-row step does. `--target random:llama-3.2-1b` (or
`random:hidden=H,layers=L,inter=I,heads=A,kv=G[,head_dim=D][,vocab=V]`) builds such a model
once under runs/random/ with the bundled tokenizer (its vocabulary, unless the shape names
one: a larger one's extra ids decode to nothing), in the Llama format the engine loads,
with random heads of the methods in RANDOM_HEADS and a PARD version beside it (where the
benchmarks look for them); its text is noise, so benchmarks pair it with
`rejection_sample_method: synthetic`.

`--target padded:models/code-target,inter=N` keeps a trained model's function and gives it a
real model's weight bytes per step: its MLPs widened to N columns that add nothing (random
gate and up rows, zero down columns: each step reads them, and every sum is the original's),
so the zoo's drafts and heads, linked beside it, draft for it with their real acceptance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from specserve import methods
from specserve.data.zoo import head_dir
from specserve.methods.parallel import NUM_SPECIAL_TOKENS
from specserve.models.llama import LlamaArgs
from specserve.models.loader import load_model, read_state_dict

PREFIX = "random:"
PADDED = "padded:"
# the public models' shapes (their vocabularies become the bundled tokenizer's)
SHAPES: dict[str, dict[str, int]] = {
    "llama-3.2-1b": dict(hidden=2048, layers=16, inter=8192, heads=32, kv=8),
    "qwen3-0.6b": dict(hidden=1024, layers=28, inter=3072, heads=16, kv=8, head_dim=128),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, inter=8960, heads=12, kv=2),
    # with Llama 3's vocabulary: the 8B target and the 1B draft of the GPU check
    "llama-3.1-8b": dict(hidden=4096, layers=32, inter=14336, heads=32, kv=8, vocab=128256),
    "llama-3.2-1b-v128k": dict(hidden=2048, layers=16, inter=8192, heads=32, kv=8,
                               vocab=128256),
}
KEYS = ("hidden", "layers", "inter", "heads", "kv", "head_dim", "vocab")
# heads built beside a random target, where the benchmarks look for them (directory suffix ->
# method, new_head options), shaped as the zoo's; DFlash's blocks of 16 as the released
# drafters' (K up to 15: a block's cost hardly grows with its rows where weights dominate)
RANDOM_HEADS: dict[str, tuple[str, dict]] = {
    "eagle3": ("eagle3", {}), "eagle3-parallel": ("eagle3", {"parallel": True}),
    "dflash": ("dflash", {"block_size": 16, "num_layers": 3})}


def parse(spec: str) -> dict[str, int]:
    """`random:NAME` or `random:hidden=H,layers=L,inter=I,heads=A,kv=G[,head_dim=D][,vocab=V]`
    -> shape."""
    body = spec.removeprefix(PREFIX)
    if body in SHAPES:
        return dict(SHAPES[body])
    try:
        shape = {k: int(v) for k, v in (item.split("=", 1) for item in body.split(","))}
    except ValueError:
        shape = {}
    missing = [k for k in KEYS[:5] if k not in shape]
    if missing or set(shape) - set(KEYS) or min(shape.values(), default=0) < 1:
        raise SystemExit(f"{spec!r}: give random:NAME ({', '.join(SHAPES)}) or "
                         "random:hidden=H,layers=L,inter=I,heads=A,kv=G[,head_dim=D][,vocab=V] with "
                         "positive integers")
    if shape["heads"] % shape["kv"] or ("head_dim" not in shape and shape["hidden"]
                                         % shape["heads"]):
        raise SystemExit(f"{spec!r}: heads must be a multiple of kv, and hidden of heads "
                         "(or give head_dim)")
    return shape


def materialize(spec: str, tokenizer_dir: str | Path, root: str | Path = "runs/random",
                seed: int = 0, device: str = "cpu") -> str:
    """The model directory of `spec` (built on first use): config.json, the tokenizer of
    `tokenizer_dir`, and weights drawn from N(0, 0.02^2) on `device` (a GPU draws 8B in a
    second), stored in bfloat16."""
    shape = parse(spec)
    tok = Path(tokenizer_dir)
    vocab = shape.get("vocab") or json.loads((tok / "config.json").read_text())["vocab_size"]
    name = spec.removeprefix(PREFIX).replace("=", "").replace(",", "-")
    out = Path(root) / f"{name}-v{vocab}-s{seed}"
    if (out / "model.safetensors").is_file():
        return str(out)
    args = LlamaArgs(architecture="LlamaForCausalLM", vocab_size=vocab,
                     hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                     num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                     num_key_value_heads=shape["kv"],
                     head_dim=shape.get("head_dim", shape["hidden"] // shape["heads"]),
                     max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling=None, tie_word_embeddings=False, attention_bias=False,
                     qk_norm=False, sliding_window=None)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device).manual_seed(seed)
    H, D, L = args.hidden_size, args.head_dim, args.num_hidden_layers
    q, kv, inter = args.num_attention_heads * D, args.num_key_value_heads * D, args.intermediate_size

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, H), "lm_head.weight": rand(vocab, H),
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(q, H),
                    p + "self_attn.k_proj.weight": rand(kv, H),
                    p + "self_attn.v_proj.weight": rand(kv, H),
                    p + "self_attn.o_proj.weight": rand(H, q),
                    p + "mlp.gate_proj.weight": rand(inter, H),
                    p + "mlp.up_proj.weight": rand(inter, H),
                    p + "mlp.down_proj.weight": rand(H, inter),
                    p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(args.to_hf_config(), indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors.partial"))
    (out / "model.safetensors.partial").rename(out / "model.safetensors")   # whole or absent
    return str(out)


def random_heads(target_dir: str, seed: int = 0, names: tuple[str, ...] = tuple(RANDOM_HEADS),
                 device: str = "cpu") -> None:
    """Random heads `names` of RANDOM_HEADS for the random target in `target_dir` (each built
    once, on `device`), weights from N(0, 0.02^2) as the target's, stored in bfloat16."""
    todo = [n for n in names if not (Path(head_dir(target_dir, n)) / "config.json").is_file()]
    if not todo:
        return
    dev = torch.device(device)
    target = load_model(target_dir, torch.float32 if dev.type == "cpu" else torch.bfloat16, dev)
    counts = np.ones(target.args.vocab_size, dtype=np.int64)
    counts[NUM_SPECIAL_TOKENS] = 0              # the first id past the special ones: a mask
    g = torch.Generator(dev).manual_seed(seed)
    for name in todo:
        method, options = RANDOM_HEADS[name]
        spec = methods.get(method)
        # EAGLE-3 over a quarter of the vocabulary, as published heads are (32k of 128k)
        draft_vocab = target.args.vocab_size // 4 if method == "eagle3" else None
        with dev:
            head = spec.new_head(target, 4, draft_vocab, counts, **options)
        with torch.no_grad():
            for param_name, p in head.named_parameters():
                if p.dim() >= 2 and not param_name.startswith(("embed_tokens.", "lm_head.")):
                    p.copy_(torch.randn(p.shape, generator=g, device=dev) * 0.02)
        spec.write(head, Path(head_dir(target_dir, name)), Path(target_dir), torch.bfloat16)


def random_pard(model_dir: str) -> None:
    """`<model_dir>-pard`: the random model as a PARD draft (its files linked, a mask token in
    its config.json), where the benchmarks look for a draft's parallel version."""
    out = Path(f"{model_dir}-pard")
    if (out / "config.json").is_file():
        return
    out.mkdir(exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((Path(model_dir) / "config.json").read_text()) | {
        "pard_token": NUM_SPECIAL_TOKENS}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def padded(spec: str, root: str | Path = "runs/padded", seed: int = 0) -> str:
    """The model directory of `padded:DIR,inter=N` (built on first use), with DIR's heads
    (`DIR-<method>`) linked beside it where the benchmarks look for them."""
    path, *opts = spec.removeprefix(PADDED).split(",")
    src = Path(path)
    try:
        inter = int(dict(o.split("=", 1) for o in opts)["inter"])
    except (KeyError, ValueError):
        raise SystemExit(f"{spec!r}: give padded:DIR,inter=N") from None
    cfg = json.loads((src / "config.json").read_text())
    if inter <= cfg["intermediate_size"]:
        raise SystemExit(f"{spec!r}: inter={inter} must exceed the model's intermediate_size "
                         f"({cfg['intermediate_size']})")
    out = Path(root) / f"{src.name}-inter{inter}"
    if not (out / "model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(seed)
        tensors = read_state_dict(src)
        for key, t in list(tensors.items()):
            if key.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):    # [I, H]
                extra = torch.randn(inter - t.shape[0], t.shape[1], generator=g) * 0.02
                tensors[key] = torch.cat([t, extra.to(t.dtype)])
            elif key.endswith("mlp.down_proj.weight"):                        # [H, I]
                tensors[key] = torch.cat([t, t.new_zeros(t.shape[0], inter - t.shape[1])], 1)
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                shutil.copy(f, out / f.name)
        (out / "config.json").write_text(json.dumps(cfg | {"intermediate_size": inter},
                                                    indent=2) + "\n")
        save_file(tensors, str(out / "model.safetensors.partial"))
        (out / "model.safetensors.partial").rename(out / "model.safetensors")
    for head in src.parent.glob(f"{src.name}-*"):
        suffix = head.name.removeprefix(src.name + "-")
        link = Path(f"{out}-{suffix}")
        # MTP lives in the target's own checkpoint: the padded one has none
        if (head / "config.json").is_file() and not link.exists() and suffix != "mtp":
            link.symlink_to(head.resolve())
    return str(out)


def resolve(path: str, tokenizer_dir: str | Path) -> str:
    """A model directory for `path`: itself, the built random model (with its random heads
    and its PARD version) for `random:...`, or the padded model for `padded:...`."""
    if path.startswith(PADDED):
        return padded(path)
    if not path.startswith(PREFIX):
        return path
    out = materialize(path, tokenizer_dir)
    random_heads(out)
    random_pard(out)
    return out
