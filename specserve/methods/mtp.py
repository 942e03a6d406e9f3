"""MTP (DeepSeek-V3 style multi-token prediction): the target's own extra layers,
block(eh_proj([enorm(embed(x_t+1)); hnorm(h_t)])), stored in the target checkpoint. Three
published layouts hold the same computation under other names:
- DeepSeek-V3: `model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm, <layer>}`,
  counted by `num_nextn_predict_layers`;
- MiMo (`MiMoForCausalLM`, a Qwen2 target): `model.mtp_layers.{i}.{token_layernorm,
  hidden_layernorm, input_proj, final_layernorm, <layer>}`, its input_proj reading
  [hidden; embedding] (the halves are swapped at load);
- Qwen3-Next (here on a Qwen3 target): `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc,
  norm, layers.0.<layer>}`, counted by `mtp_num_hidden_layers` (one layer only).
Several layers take turns over the draft steps, as vLLM runs them: the first is fed the
target's states, layer i drafts token i+1 from layer i-1's output, and each keeps its own KV
cache."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specserve.config import SpeculativeConfig
from specserve.methods.base import DraftContext, MethodSpec
from specserve.methods.checkpoints import (
    add_shard,
    assign_weights,
    embedding_of,
    layer_args,
    layer_tensors,
    to_dtype,
)
from specserve.methods.head_proposer import HeadProposer
from specserve.models.heads import ChainParts, StatefulHead
from specserve.models.layers import RMSNorm
from specserve.models.llama import DecoderLayer, LlamaArgs
from specserve.models.loader import fuse_hf_names, load_hf_config, read_state_dict


class MTPLayer(StatefulHead):
    """DeepSeek-style multi-token prediction layer stored in the target checkpoint:
    out = block(eh_proj([enorm(embed(token)); hnorm(h)])); logits = lm_head(shared_head.norm(out))."""

    def __init__(self, args: LlamaArgs, embed: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__(args, embed, lm_head)
        H = args.hidden_size
        self.enorm = RMSNorm(H, args.rms_norm_eps)
        self.hnorm = RMSNorm(H, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = DecoderLayer(args)
        self.shared_head_norm = RMSNorm(H, args.rms_norm_eps)

    def forward(self, token_ids, h, positions, md, cache):
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(token_ids)), self.hnorm(h)], -1))
        return self.block(x, self.rotary.tables(positions, x.dtype), md, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.shared_head_norm(out))

    def chain_parts(self) -> ChainParts:
        return ChainParts(self.block, self.enorm, self.hnorm, self.eh_proj,
                          self.shared_head_norm, None)


class MTPStack(StatefulHead):
    """Several MTP layers sharing the target's embedding; draft step i runs layer i mod n."""

    def __init__(self, layers: list[MTPLayer]) -> None:
        super().__init__(layers[0].args, layers[0].embed_tokens, None)
        self.layers = nn.ModuleList(layers)

    @property
    def num_step_layers(self) -> int:
        return len(self.layers)

    def step_head(self, step: int) -> MTPLayer:
        return self.layers[step % len(self.layers)]

    def forward(self, token_ids, h, positions, md, cache):
        return self.layers[0](token_ids, h, positions, md, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.layers[0].logits(out)


def new_head(target: nn.Module, k: int, draft_vocab: int | None = None,
             token_counts=None) -> MTPLayer:
    return MTPLayer(layer_args(target.args), target.embed_tokens, target.lm_head)


# Each layout's names of the MTP layer's own parts -> DeepSeek's (the decoder layer's tensors
# keep their names)
_DEEPSEEK = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.",
             "shared_head.norm.": "shared_head_norm.", "shared_head.head.": "lm_head.",
             "embed_tokens.": "embed_tokens."}
_MIMO = {"token_layernorm.": "enorm.", "hidden_layernorm.": "hnorm.", "input_proj.": "eh_proj.",
         "final_layernorm.": "shared_head_norm."}
_QWEN3_NEXT = {"pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
               "fc.": "eh_proj.", "norm.": "shared_head_norm."}


def num_layers(cfg: dict) -> int:
    """MTP layers a config counts: DeepSeek's and MiMo's num_nextn_predict_layers, or
    Qwen3-Next's mtp_num_hidden_layers."""
    return cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0


def read(path: str | Path, target: nn.Module) -> MTPLayer | MTPStack:
    d = Path(path)
    cfg = load_hf_config(d)
    n = num_layers(cfg)
    if not n:
        raise ValueError(f"{d / 'config.json'}: no MTP layer: num_nextn_predict_layers "
                         "(DeepSeek-V3, MiMo) and mtp_num_hidden_layers (Qwen3-Next) are 0 or "
                         "missing")
    tensors = read_state_dict(d)
    L = target.args.num_hidden_layers
    if any(k.startswith("model.mtp_layers.") for k in tensors):
        layers = [_read_layer(tensors, f"model.mtp_layers.{i}.", _MIMO, target, d)
                  for i in range(n)]
        for layer in layers:        # MiMo's input_proj reads [hidden; embedding]
            w = layer.eh_proj.weight.data
            w.copy_(torch.cat(w.chunk(2, dim=1)[::-1], dim=1))
    elif any(k.startswith("mtp.") for k in tensors):
        if n != 1:
            raise ValueError(f"{d / 'config.json'}: mtp_num_hidden_layers={n}: a Qwen3-Next MTP "
                             "module of several decoder layers is not supported (only 1)")
        layers = [_read_layer(tensors, "mtp.", _QWEN3_NEXT, target, d)]
    else:
        layers = [_read_layer(tensors, f"model.layers.{L + i}.", _DEEPSEEK, target, d)
                  for i in range(n)]
    if n == 1:
        return layers[0]
    for layer in layers[1:]:                # one embedding, as the checkpoint shares it
        layer.embed_tokens = layers[0].embed_tokens
    return MTPStack(layers)


def _read_layer(tensors: dict[str, torch.Tensor], prefix: str, names: dict[str, str],
                target: nn.Module, d: Path) -> MTPLayer:
    raw = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not raw:
        raise ValueError(f"{d}: the config counts an MTP layer {prefix}* that the checkpoint "
                         "does not hold")
    state = {}
    for k, v in raw.items():
        part = next((p for p in names if k.startswith(p)), None)
        if part is not None:
            state[names[part] + k[len(part):]] = v
        else:           # the decoder layer (Qwen3-Next's under layers.0.)
            state["layers.0." + k.removeprefix("layers.0.")] = v
    state = {("block." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
             for k, v in fuse_hf_names(state, 1).items()}
    emb = embedding_of(state, target, target.args.vocab_size, target.args.hidden_size)
    lm_head = target.lm_head
    if "lm_head.weight" in state:
        lm_head = nn.Linear(target.args.hidden_size, target.args.vocab_size, bias=False)
        lm_head.weight.data.copy_(state.pop("lm_head.weight"))
    layer = MTPLayer(target.args, emb, lm_head)
    assign_weights(layer, state, f"{d} ({prefix}*)",
                   optional=("embed_tokens.", "lm_head.", "rotary."))
    return layer


def write(head: MTPLayer, out: Path, target_dir: Path, dtype: torch.dtype) -> None:
    """A directory target: its directory plus the MTP layer as one more shard (the target's
    weight shards are relative symlinks, not copies: the MTP layer is small, the target is
    not; `cp -rL` makes a self-contained copy). A GGUF target: the MTP layer alone with the
    target's config, given as speculative_config 'model' beside that target."""
    out.mkdir(parents=True, exist_ok=True)
    a = head.args
    is_dir = Path(target_dir).is_dir()
    cfg = (json.loads((target_dir / "config.json").read_text()) if is_dir
           else load_hf_config(target_dir)) | {"num_nextn_predict_layers": 1}
    p = f"model.layers.{cfg['num_hidden_layers']}."     # MTP layers follow the decoder
    tensors = {p + "enorm.weight": head.enorm.weight, p + "hnorm.weight": head.hnorm.weight,
               p + "eh_proj.weight": head.eh_proj.weight,
               p + "shared_head.norm.weight": head.shared_head_norm.weight}
    tensors = to_dtype(tensors | layer_tensors(head.block, a, p), dtype)
    if is_dir:
        for f in target_dir.iterdir():
            if f.name == "model-mtp.safetensors" or not f.is_file():
                continue
            dst = out / f.name
            dst.unlink(missing_ok=True)
            if f.suffix == ".safetensors":
                dst.symlink_to(os.path.relpath(f.resolve(), out.resolve()))
            elif f.suffix == ".json":
                shutil.copy(f, dst)
        add_shard(out, tensors)
    else:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def loss(head: MTPLayer, x, pos, h, aux, logp, k: int, distill):
    out = head(x[:, 1:], head.fuse_target(h[:, :-1]), pos[:, :-1], None, None)  # [B, S-1, H]
    kl = distill(head.logits(out), logp[:, 1:])
    return kl, {"kl": kl.item(), "loss": kl.item()}


def build(config: SpeculativeConfig, ctx: DraftContext) -> HeadProposer:
    return HeadProposer(config, ctx, read(config.model or ctx.target_path, ctx.target))


SPEC = MethodSpec(
    name="mtp", build=build, summary="the target's own multi-token-prediction layer",
    detect=("mtp",), reads_hidden_states=True, drafts_trees=True, steps_drafts=True, shards=True,
    model_is_target=True, repeats_layers=True, new_head=new_head, read=read, write=write,
    loss=loss,
    # one draft per MTP layer (vLLM's n_predict for MTP)
    default_k=lambda path: num_layers(load_hf_config(path)) or None)
