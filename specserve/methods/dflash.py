"""DFlash (Chen et al. 2026, arXiv 2602.06036; z-lab checkpoint format): a few Qwen3-style
layers draft a whole block in one pass.

The target's hidden states of `target_layer_ids` (the outputs of those layers) are concatenated,
projected by `fc` and normed (`hidden_norm`): the context. Every drafter layer turns the context
into keys and values with its own k/v projections (no input norm, no queries) and keeps them in
its KV cache at the context's positions. Each step the drafter runs one block
`[last token, mask x K]` at positions q..q+K, embedded with the target's embedding; the block
attends to the context before q and to the whole block (not causally). The target's lm_head on
mask row j gives draft j (the token at q+j). The block's own keys and values are scratch: the
next step writes the newly verified positions' context over them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import SpeculativeConfig
from specserve.kernels.cpu import KVWriter
from specserve.methods.base import DraftContext, MethodSpec, Proposal, ProposeBatch, ProposerBase
from specserve.methods.checkpoints import (
    assign_weights,
    check_target,
    head_args,
    layer_args,
    layer_tensors,
    write_head,
)
from specserve.methods.parallel import depth_weights, drafts_from_rows, first_unused, mask_token_id
from specserve.models.layers import RMSNorm, Rotary, apply_rotary, model_tensor
from specserve.models.llama import DecoderLayer, LlamaArgs
from specserve.models.loader import fuse_hf_names, load_hf_config, read_state_dict
from specserve.models.metadata import build_tree_metadata

DEFAULT_BLOCK_SIZE = 8
DEFAULT_NUM_LAYERS = 2
# Blocks per training window by default: every anchor trains block_size - 1 drafts, and the
# logits of them all are held at once (32 x 7 rows x 8192 x 4 bytes = 7 MB per window at B = 8).
NUM_ANCHORS = 32
TRAIN_HINT = "train one for this target with `specserve train dflash --target DIR --out DIR`"


class DFlashDrafter(nn.Module):
    """The drafter: its layers, fc + hidden_norm over the target's features, the final norm;
    the embedding and lm_head are the target's (never trained, not in the checkpoint)."""

    def __init__(self, args: LlamaArgs, target_layer_ids: tuple[int, ...], target_hidden: int,
                 block_size: int, mask_token_id: int, embed: nn.Embedding,
                 lm_head: nn.Module, num_anchors: int = NUM_ANCHORS) -> None:
        super().__init__()
        H = args.hidden_size
        self.args = args
        self.target_layer_ids = tuple(target_layer_ids)
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.fc = nn.Linear(len(target_layer_ids) * target_hidden, H, bias=False)
        self.hidden_norm = RMSNorm(H, args.rms_norm_eps)
        self.norm = RMSNorm(H, args.rms_norm_eps)
        self.embed_tokens, self.lm_head = embed, lm_head
        self.rotary = Rotary(args.head_dim, args.max_position_embeddings, args.rope_theta,
                             args.rope_scaling)
        self.num_anchors = num_anchors      # training: blocks per window (`loss`)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the runner hands over: the output of layer i is the
        input of layer i + 1 (vLLM's off-by-one fix, PR 40727)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @aux_layers.setter
    def aux_layers(self, layers: tuple[int, ...]) -> None:
        """Read other target layers (as many as fc takes): those of hidden-state files."""
        n = self.fc.in_features // self.embed_tokens.embedding_dim
        if len(layers) != n or min(layers) < 1:
            raise ValueError(f"a dflash drafter reads the outputs of {n} target layers, not the "
                             f"layer inputs {list(layers)}")
        self.target_layer_ids = tuple(i - 1 for i in layers)

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target features [..., n * H_target] -> context [..., H]."""
        return self.hidden_norm(self.fc(aux_hidden))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))                                 # [..., V]

    @torch.no_grad()        # else the copies record autograd history: non-leaf parameters
    def fuse_context_kv(self) -> None:
        """For inference: every layer's k and v rows of qkv_proj stacked into one linear
        (`context_kv`): one product per step instead of one per layer, whose calls cost more
        than their few weights."""
        attns = [layer.self_attn for layer in self.layers]
        q, bias = attns[0].q_size, attns[0].qkv_proj.bias
        w = torch.cat([at.qkv_proj.weight[q:] for at in attns])          # [L * 2 * Hkv * D, H]
        self.kv_proj = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
        self.kv_proj.requires_grad_(False)
        self.kv_proj.weight.copy_(w)
        if bias is not None:
            self.kv_proj.bias.copy_(torch.cat([at.qkv_proj.bias[q:] for at in attns]))
        norms = [at.k_norm for at in attns]
        self.k_norms = None if norms[0] is None else nn.Parameter(
            torch.stack([n.weight for n in norms])[:, None], requires_grad=False)   # [L, 1, D]

    def context_kv(self, c: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [T, L, Hkv, D] of every layer for context c [T, H]
        (`fuse_context_kv` first): what each layer's `project_kv` gives."""
        at = self.layers[0].self_attn
        kv = self.kv_proj(c).view(c.shape[0], len(self.layers), 2, at.num_kv_heads, at.head_dim)
        k, v = kv.unbind(2)
        if self.k_norms is not None:
            k = F.rms_norm(k, (at.head_dim,), eps=at.k_norm.eps) * self.k_norms
        return apply_rotary(k.flatten(1, 2), cos_sin).view_as(k), v

    def block(self, ids: torch.Tensor, positions: torch.Tensor, md,
              caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Cached inference: the block rows ids [T] at `positions` [T] through every layer,
        attending as `md` says (the context in `caches` and the whole block) -> [T, H]."""
        x = self.embed_tokens(ids)
        cos_sin = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos_sin, md, cache)
        return x

    def forward(self, blocks: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                ctx_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Dense training: blocks, block_pos [B, N] (block rows), ctx [B, S, H] (the context),
        ctx_pos [B, S]; mask [B, 1, N, S + N] bool, True = may attend (the context first, then
        the block rows) -> block outputs [B, N, H]."""
        x = self.embed_tokens(blocks)
        cs_block = self.rotary.tables(block_pos, x.dtype)
        cs_ctx = self.rotary.tables(ctx_pos, x.dtype)
        for layer in self.layers:
            at = layer.self_attn
            q, k, v = at.project(layer.input_layernorm(x), cs_block)         # [B, N, *, D]
            kc, vc = at.project_kv(ctx, cs_ctx)                               # [B, S, Hkv, D]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), torch.cat([kc, k], 1).transpose(1, 2),
                torch.cat([vc, v], 1).transpose(1, 2), attn_mask=mask, scale=at.scale,
                enable_gqa=True)                                              # [B, Hq, N, D]
            x = x + at.o_proj(o.transpose(1, 2).flatten(2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


def default_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """n target layers spread evenly from layer 1 to L-3 (z-lab's choice), within the 0..L-2
    whose outputs the runner can hand over."""
    lo = min(1, num_target_layers - 2)
    hi = max(lo, num_target_layers - 3)
    if n == 1:
        return ((lo + hi) // 2,)
    return tuple(round(lo + i * (hi - lo) / (n - 1)) for i in range(n))


def loss_weights(block_size: int) -> torch.Tensor:
    """Weights of block positions 1..B-1: exp(-(k-1)/gamma), gamma 4 at B=8 and 7 at B=16
    (the paper's choices), so that the early drafts, which every later one needs, count most."""
    return depth_weights(block_size - 1, max(1.0, 4 + 3 * (block_size - 8) / 8))


def new_head(target: nn.Module, k: int, draft_vocab: int | None = None,
             token_counts: np.ndarray | None = None, block_size: int | None = None,
             num_layers: int | None = None, num_anchors: int = NUM_ANCHORS,
             num_target_layers: int | None = None) -> DFlashDrafter:
    """A fresh drafter of `num_layers` target-wide Qwen3 layers for blocks of `block_size`
    (default: K + 1, at least DEFAULT_BLOCK_SIZE), reading `num_target_layers` target layers
    (default: as many as its own, z-lab's choice); its mask token is the lowest id unused in
    `token_counts`; `num_anchors`: blocks per training window (`loss`)."""
    a = target.args
    n = num_layers or DEFAULT_NUM_LAYERS
    block = block_size or max(k + 1, DEFAULT_BLOCK_SIZE)
    if k > block - 1:
        raise ValueError(f"a block of {block} drafts at most {block - 1} tokens, not K={k}; "
                         f"give --block-size {k + 1} or more")
    if token_counts is None:
        raise ValueError("a new dflash drafter needs token counts to choose its mask token")
    mask = first_unused(token_counts)
    args = dataclasses.replace(layer_args(a), architecture="Qwen3ForCausalLM", qk_norm=True,
                               num_hidden_layers=n)
    return DFlashDrafter(args, default_layer_ids(a.num_hidden_layers, num_target_layers or n),
                         a.hidden_size, block,
                         mask, target.embed_tokens, target.lm_head, num_anchors)


def _config(path: Path) -> dict:
    cfg = load_hf_config(path)
    return cfg | {"dflash_config": cfg.get("dflash_config") or {}}


def _block_size(cfg: dict, source: str) -> int:
    block = cfg.get("block_size") or cfg["dflash_config"].get("block_size")
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{source}: a dflash checkpoint needs block_size (an int >= 2)")
    return block


def default_k(path: str) -> int | None:
    """K = block_size - 1: the block the drafter was trained on, less its first row."""
    d = Path(path)
    return _block_size(_config(d), str(d / "config.json")) - 1 if d.is_dir() else None


def read(path: str | Path, target: nn.Module) -> DFlashDrafter:
    d = Path(path)
    cfg = _config(d)
    src = str(d / "config.json")
    ta = target.args
    args = head_args(cfg | {"architectures": ["Qwen3ForCausalLM"]}, ta, src)
    check_target(src, "hidden_size", args.hidden_size, ta.hidden_size)
    check_target(src, "vocab_size", args.vocab_size, ta.vocab_size)
    if cfg.get("num_target_layers") not in (None, ta.num_hidden_layers):
        check_target(src, "number of target layers", cfg["num_target_layers"],
                     ta.num_hidden_layers)
    ids = cfg["dflash_config"].get("target_layer_ids") or cfg.get("target_layer_ids")
    if not ids:
        ids = default_layer_ids(ta.num_hidden_layers, args.num_hidden_layers)
    # the runner hands over layer inputs, so the last layer's output is not available
    if any(not 0 <= i < ta.num_hidden_layers - 1 for i in ids):
        raise ValueError(f"{src}: target_layer_ids {list(ids)} must lie in 0.."
                         f"{ta.num_hidden_layers - 2} for this {ta.num_hidden_layers}-layer "
                         "target; this drafter was trained for another model")
    state = {k.removeprefix("model."): v for k, v in read_state_dict(d).items()}
    fc_in = state["fc.weight"].shape[1] if "fc.weight" in state else None
    if fc_in is not None and fc_in != len(ids) * ta.hidden_size:
        raise ValueError(f"{src}: fc reads {fc_in} features, but {len(ids)} target layers of "
                         f"hidden size {ta.hidden_size} give {len(ids) * ta.hidden_size}; this "
                         "drafter was trained for another model")
    mask = mask_token_id(cfg, str(d), TRAIN_HINT)
    if not 0 <= mask < ta.vocab_size:
        raise ValueError(f"{src}: mask token {mask} is outside the target's vocabulary "
                         f"[0, {ta.vocab_size})")
    drafter = DFlashDrafter(args, tuple(ids), ta.hidden_size, _block_size(cfg, src), mask,
                            target.embed_tokens, target.lm_head)
    assign_weights(drafter, fuse_hf_names(state, args.num_hidden_layers), str(d),
                   optional=("embed_tokens.", "lm_head.", "rotary."))
    return drafter


def write(drafter: DFlashDrafter, out: Path, target_dir: Path, dtype: torch.dtype) -> None:
    """The z-lab layout: no embed_tokens, no lm_head, no `model.` prefix."""
    a = drafter.args
    cfg = a.to_hf_config() | {
        "architectures": ["DFlashDraftModel"],
        "num_target_layers": load_hf_config(target_dir)["num_hidden_layers"],
        "block_size": drafter.block_size,
        "dflash_config": {"mask_token_id": drafter.mask_token_id,
                          "target_layer_ids": list(drafter.target_layer_ids)}}
    tensors = {"fc.weight": drafter.fc.weight, "hidden_norm.weight": drafter.hidden_norm.weight,
               "norm.weight": drafter.norm.weight}
    for i, layer in enumerate(drafter.layers):
        tensors |= layer_tensors(layer, a, f"layers.{i}.")
    write_head(out, cfg, tensors, dtype)


def anchors_of(x: torch.Tensor, block_size: int, num: int) -> torch.Tensor:
    """[B, A] distinct random block starts in 1..S-block_size per row of x [B, S] (at least one
    context position before each). The draw is seeded by the batch's tokens, so a resumed run
    draws what the uninterrupted one did."""
    B, S = x.shape
    span = S - block_size
    if span < 1:
        raise ValueError(f"training windows of {S} tokens are too short for blocks of "
                         f"{block_size}; raise --seq-len")
    g = torch.Generator().manual_seed(int(x[:, :64].sum()))
    return torch.rand(B, span, generator=g).argsort(1)[:, :min(num, span)].to(x.device) + 1


def loss(drafter: DFlashDrafter, x, pos, h, aux, logp, k: int, distill):
    """KL to the target at each block position 1..B-1 (the target's distribution of the token
    there), weighted by `loss_weights`. Blocks start at random anchors; a block sees the
    context strictly before its anchor and its own rows, not other blocks."""
    Bk = drafter.block_size
    anchors = anchors_of(x, Bk, drafter.num_anchors)                         # [B, A]
    B, A = anchors.shape
    steps = torch.arange(Bk, device=x.device)
    blocks = torch.full((B, A, Bk), drafter.mask_token_id, dtype=torch.long, device=x.device)
    blocks[:, :, 0] = x.gather(1, anchors)
    block_pos = pos.gather(1, anchors)[:, :, None] + steps                   # [B, A, Bk]
    sees_ctx = torch.arange(x.shape[1], device=x.device) < anchors[:, :, None]      # [B, A, S]
    own = torch.eye(A, dtype=torch.bool, device=x.device)
    mask = torch.cat([sees_ctx.repeat_interleave(Bk, 1),
                      own.repeat_interleave(Bk, 0).repeat_interleave(Bk, 1).expand(B, -1, -1)],
                     -1).unsqueeze(1)                                         # [B, 1, A*Bk, S+A*Bk]
    out = drafter(blocks.flatten(1), block_pos.flatten(1), drafter.context(aux), pos, mask)
    out = out.view(B, A, Bk, -1)[:, :, 1:]                                   # [B, A, Bk-1, H]
    # the target's distribution of the token at anchor + j sits at row anchor + j - 1
    rows = (anchors[:, :, None] + steps[:-1]).flatten(1)                     # [B, A*(Bk-1)]
    target = logp.gather(1, rows[..., None].expand(-1, -1, logp.shape[-1]))
    target = target.view(B, A, Bk - 1, -1)
    w = loss_weights(Bk).to(x.device)
    # logits per block position: slicing [B, A, Bk-1, V] logits would back-propagate through
    # a zero-filled copy of all of them per position
    kls = [distill(drafter.logits(out[:, :, j]), target[:, :, j]) for j in range(Bk - 1)]
    total = sum(wj * kl for wj, kl in zip(w, kls)) / w.sum()
    return total, {"kl_first": kls[0].item(), "kl_last": kls[-1].item(), "loss": total.item()}


class DFlashProposer(ProposerBase):
    """Writes the context of every position the target verified, then drafts all requests'
    blocks in one drafter pass (ragged: each request's block has its budget of masks)."""

    def __init__(self, config: SpeculativeConfig, ctx: DraftContext) -> None:
        drafter = read(config.model, ctx.target)
        drafter.fuse_context_kv()
        self.drafter = ctx.backend.prepare(drafter)
        a = self.drafter.args
        max_len = ctx.max_model_len + config.num_speculative_tokens + 1
        self.drafter.rotary = Rotary(a.head_dim, max_len, a.rope_theta, a.rope_scaling).to(
            ctx.device)
        self.dtype = model_tensor(self.drafter).dtype      # what the drafter computes in
        # the block in one compiled call where the backend has one (the embedding, every layer
        # and the final norm; layer by layer in PyTorch the calls cost more than the weights)
        self.forward = ctx.backend.forward(self.drafter)
        self.cache = ctx.new_kv_cache(a.num_hidden_layers, a.num_key_value_heads, max_len,
                                      a.head_dim, self.dtype)
        # the context's keys and values into every layer's cache in one C call likewise
        self.write_kv = None if self.forward is None else KVWriter(
            self.forward.lib, self.cache.layers, self.drafter.k_norms, a.rms_norm_eps,
            self.drafter.rotary.cos_sin)
        self.caches = [self.cache]
        self.modules = {"drafter": self.drafter}
        self.aux_hidden_layers = self.drafter.aux_layers
        self.device = ctx.device
        self.sample = config.draft_sample_method == "probabilistic"
        self.threshold = config.draft_confidence_threshold
        self.num_written: dict[str, int] = {}       # request id -> positions of its context

    reuses_prefix = True

    def prefix_positions(self, request) -> int:
        return self.num_written.get(request.request_id, 0)

    def resume_prefix(self, request, num_positions: int) -> None:
        self.num_written[request.request_id] = num_positions

    def finish(self, request) -> None:
        self.num_written.pop(request.request_id, None)

    def _write_context(self, batch: ProposeBatch) -> None:
        """The context keys and values of the positions each request of the step verified."""
        out = batch.runner_output
        rows, slots, positions = [], [], []
        for i, r in enumerate(batch.step_requests):
            if r.is_finished:
                continue
            lo, hi = out.rows(i, r.num_computed_tokens)
            self.num_written[r.request_id] = r.num_computed_tokens
            rows += range(lo, hi)
            slots += [r.slot] * (hi - lo)
            positions += range(out.starts[i], r.num_computed_tokens)
        if not positions:
            return
        rows_t, slot, pos = torch.tensor([rows, slots, positions], device=self.device)
        c = self.drafter.context(out.aux_hidden[rows_t].to(self.dtype))      # [T, H]
        if self.write_kv is not None:
            self.write_kv(self.drafter.kv_proj(c), slot, pos)
            return
        k, v = self.drafter.context_kv(c, self.drafter.rotary.tables(pos, c.dtype))
        for i, (k_cache, v_cache) in enumerate(self.cache.layers):         # k, v: [T, L, Hkv, D]
            k_cache[slot, :, pos] = k[:, i]
            v_cache[slot, :, pos] = v[:, i]

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        self._write_context(batch)
        reqs, budgets = batch.requests, batch.max_num_tokens
        if not reqs:
            return []
        mask = self.drafter.mask_token_id
        ids, store, mask_rows = [], [], []
        for r, n in zip(reqs, budgets):
            q = r.num_tokens - 1               # the last token's position: the context ends there
            assert r.num_computed_tokens == q, "the block starts after the verified context"
            mask_rows += range(len(ids) + 1, len(ids) + 1 + n)
            ids += [r.all_token_ids[-1]] + [mask] * n
            store.append(list(range(q, q + n + 1)))
        # every block row sees the context and its whole block: < q + n + 1
        md = build_tree_metadata([r.slot for r in reqs], store,
                                 [[s[-1] + 1] * len(s) for s in store],
                                 [[[] for _ in s] for s in store], self.device)
        ids_t = torch.tensor(ids, device=self.device)
        rows = torch.tensor(mask_rows, device=self.device)
        if self.forward is not None:
            h = self.forward(ids_t, md.positions, md, self.cache.layers, ())    # [T, H], normed
            logits = self.drafter.lm_head(h[rows]).float()                   # [sum(n), V]
        else:
            out = self.drafter.block(ids_t, md.positions, md, self.cache.layers)      # [T, H]
            logits = self.drafter.logits(out[rows]).float()
        return drafts_from_rows(logits, budgets, reqs, self.sample, self.threshold)


def configure(config: SpeculativeConfig) -> None:
    config.parallel_drafting = True         # what DFlash is (vLLM sets it the same way)


SPEC = MethodSpec(
    name="dflash", build=DFlashProposer,
    summary="block drafter on several target layers: K drafts in one non-causal pass",
    detect=("dflash",), needs_model=True, reads_hidden_states=True, steps_drafts=True,
    samples_drafts=True, drafts_in_parallel=True, default_k=default_k, configure=configure,
    new_head=new_head, read=read, write=write, loss=loss)
