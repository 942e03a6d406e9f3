"""`specserve train {eagle,eagle3,medusa,mlp_speculator,mtp}`: train a draft head for a target.

Training data come from the target itself: its hidden states and next-token distributions over
corpus text and over continuations it generates (so the head learns the target's own
trajectories). Every head is trained against the target's distribution (KL), not the corpus
tokens, because acceptance is agreement with the target (`--top1-weight` adds a cross-entropy
to the target's most likely token: greedy verification accepts that token only):
- medusa: head i on h_t vs the target's distribution for token t+i+2;
- mlp_speculator: stage i (teacher-forced with the true tokens) vs the target at t+i+1;
- eagle: layer(fc([embed(x_t+1); h_t])) vs the target at t+1, plus feature regression to h_t+1
  (smooth L1, as in EAGLE);
- eagle3: the same over fc-fused aux states and the draft vocabulary, unrolled for K draft
  steps (EAGLE-3's training-time test): each further pass feeds the head's own outputs back and
  attends as the drafting chain does (`unrolled_drafts`; with fewer passes than K, the last
  drafts were never trained);
- mtp: the MTP layer over (h_t, x_t+1) vs the target at t+1.
The result is written in the public format the loader reads, then tau is measured on held-out
prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.config import HEAD_METHODS
from specserve.models.head_loader import read_head
from specserve.models.heads import Eagle3Head, EagleHead, MedusaHeads, MLPSpeculator, MTPLayer
from specserve.models.llama import LlamaArgs
from specserve.models.loader import load_model
from specserve.train.corpus import Corpus
from specserve.train.generated import GeneratedData, fit_prompts, with_generated
from specserve.train.lm import _setup, prepare_data
from specserve.train.trainer import TrainConfig, _positions, train

MLP_INNER_DIM = 256         # MLP speculator state width: its two vocab matrices dominate its size


def head_dir(target: str | Path, method: str) -> str:
    """Where the zoo keeps `method`'s head for `target`: models/code-target-eagle3, ...; for
    mtp the target plus its MTP layer (that directory is the model the engine loads)."""
    return f"{str(target).rstrip('/')}-{method.replace('_', '-')}"


def _layer_args(target: LlamaArgs) -> LlamaArgs:
    """A head's decoder layer has the target's width and attention shape."""
    a = LlamaArgs(**{k: getattr(target, k) for k in target.__dataclass_fields__})
    a.num_hidden_layers = 1
    return a


def build_head(method: str, target, k: int, draft_vocab: int | None = None,
               token_counts: np.ndarray | None = None) -> nn.Module:
    """A fresh head for `target`. eagle3 with `draft_vocab` < the target's vocabulary keeps the
    `draft_vocab` target ids most frequent in `token_counts` [V] (as EAGLE-3 does)."""
    a = target.args
    if method == "medusa":          # heads share the target's (frozen) lm_head: small files
        return MedusaHeads(a.hidden_size, a.vocab_size, k, num_layers=1,
                           shared_lm_head=target.lm_head)
    if method == "mlp_speculator":  # stages share embedding and head (IBM's tie_weights)
        return MLPSpeculator(a.hidden_size, MLP_INNER_DIM, a.vocab_size, k, tie_weights=True)
    if method == "eagle":
        return EagleHead(_layer_args(a), fc_bias=True, embed=target.embed_tokens,
                         lm_head=target.lm_head)
    if method == "eagle3":
        n = min(draft_vocab or a.vocab_size, a.vocab_size)
        head = Eagle3Head(_layer_args(a), 3, a.hidden_size, n, a.vocab_size, target.embed_tokens)
        if n < a.vocab_size:
            if token_counts is None:
                raise ValueError("a reduced eagle3 draft vocabulary needs token counts")
            ids = torch.from_numpy(np.sort(np.argsort(-token_counts, kind="stable")[:n]))
            head.d2t.copy_(ids - torch.arange(n))
        L = a.num_hidden_layers
        head.aux_layers = (min(2, L - 1), L // 2, max(0, L - 3))
        return head
    if method == "mtp":
        return MTPLayer(_layer_args(a), target.embed_tokens, target.lm_head)
    raise ValueError(f"unknown head method {method!r}; choose from {', '.join(HEAD_METHODS)}")


def _init_from(head: nn.Module, method: str, d: Path, target,
               refresh_vocab: bool = False) -> None:
    """Copy the trained head in `d` into `head` (built for this run's shape); any mismatch (a
    different K, draft vocabulary or width) is an error that names it. With `refresh_vocab`
    (eagle3) `head` keeps the draft vocabulary it was built with (this run's most frequent
    tokens, of any size): see `_remap_vocab`."""
    if refresh_vocab and method != "eagle3":
        raise ValueError("refreshing the draft vocabulary applies to eagle3 heads only")
    loaded = read_head(method, d, target)
    trained = loaded.state_dict()
    if refresh_vocab:
        trained = _remap_vocab(trained, head.d2t, target.lm_head.weight)
    own = head.state_dict()
    bad = sorted(k for k in own.keys() | trained.keys()
                 if k not in own or k not in trained or own[k].shape != trained[k].shape)
    if bad:
        raise ValueError(f"--init {d}: that {method} head does not match the one being trained "
                         f"(tensors {', '.join(bad[:6])} differ); give the same "
                         "--num-speculative-tokens and --draft-vocab-size it was trained with")
    head.load_state_dict(trained)
    if hasattr(loaded, "aux_layers"):           # eagle3: the target layers it was trained on
        head.aux_layers = loaded.aux_layers


def _remap_vocab(trained: dict[str, torch.Tensor], d2t: torch.Tensor,
                 target_lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    """A trained eagle3 state dict moved to the draft vocabulary `d2t` [n]: a token both
    vocabularies hold keeps its trained lm_head row; a new one starts from the target's row for
    it, scaled by the mean row-norm ratio of the head to the target over the kept tokens (the
    head's output space only approximates the target's, and training takes it from there)."""
    old_ids = torch.arange(len(trained["d2t"])) + trained["d2t"]              # [n_old] target ids
    new_ids = torch.arange(len(d2t)) + d2t                                     # [n] target ids
    row_of = {t: j for j, t in enumerate(old_ids.tolist())}
    both = [j for j, t in enumerate(new_ids.tolist()) if t in row_of]          # new draft ids
    kept = [row_of[int(new_ids[j])] for j in both]                             # their old ids
    ref = kept or list(range(len(old_ids)))              # the rows the scale is measured on
    rows = trained["lm_head.weight"]                                           # [n_old, H]
    scale = rows[ref].norm(dim=1).mean() / target_lm_head[old_ids[ref]].norm(dim=1).mean()
    lm = target_lm_head.detach()[new_ids] * scale                              # [n, H]
    lm[both] = rows[kept]
    return {**trained, "lm_head.weight": lm, "d2t": d2t.clone()}


def _distill(logits: torch.Tensor, target_logp: torch.Tensor,
             top1_weight: float = 0.0) -> torch.Tensor:
    """KL(target || head) averaged over positions, plus top1_weight x the cross-entropy to the
    target's most likely token (the only draft greedy verification accepts); both [..., V]."""
    logp = F.log_softmax(logits.float(), -1).flatten(0, -2)                  # [N, V]
    target_logp = target_logp.flatten(0, -2)
    loss = F.kl_div(logp, target_logp, log_target=True, reduction="batchmean")
    if top1_weight:
        loss = loss + top1_weight * F.nll_loss(logp, target_logp.argmax(-1))
    return loss


def _target_pass(target, x: torch.Tensor, aux_layers: tuple[int, ...],
                 vocab_ids: torch.Tensor | None = None):
    """The frozen target over x [B, S]: positions, final hidden [B, S, H], aux hidden (or None)
    and next-token log-probabilities [B, S, V] (over `vocab_ids` only, when given)."""
    pos = _positions(x)
    with torch.no_grad():
        if aux_layers:
            h, aux = target(x, pos, aux_layers=aux_layers)
        else:
            h, aux = target(x, pos), None
        logits = target.compute_logits(h).float()                          # [B, S, V]
        if vocab_ids is not None:
            logits = logits[..., vocab_ids]
        return pos, h, aux, F.log_softmax(logits, -1)


def head_loss(method: str, head: nn.Module, target, k: int, top1_weight: float = 0.0):
    """Loss function over a token batch [B, S + 1] (see the module docstring); eagle3 is
    unrolled for the k draft steps it serves at K = k. top1_weight: see `_distill`."""
    aux_layers = tuple(getattr(head, "aux_layers", ()))

    def fn(xy: torch.Tensor):
        x = xy[:, :-1]                                                     # [B, S]
        # eagle3: the target's distribution over the draft vocabulary
        vocab = head.draft_to_target() if method == "eagle3" else None
        return _method_loss(method, head, x, *_target_pass(target, x, aux_layers, vocab), k,
                            top1_weight)
    return fn


def joint_head_loss(heads: nn.ModuleDict, target, k: int, top1_weight: float = 0.0):
    """One loss for several heads that read the target's last hidden state: the target runs
    once per batch for all of them (the frozen target pass is most of a small head's step)."""
    def fn(xy: torch.Tensor):
        x = xy[:, :-1]
        pos, h, _, logp = _target_pass(target, x, ())
        total, values = 0.0, {}
        for method, head in heads.items():
            loss, v = _method_loss(method, head, x, pos, h, None, logp, k, top1_weight)
            total = total + loss
            values |= {f"{method}_{name}": val for name, val in v.items()}
        return total, values | {"loss": total.item()}
    return fn


def _method_loss(method: str, head: nn.Module, x, pos, h, aux, logp, k: int,
                 top1_weight: float):
    S = x.shape[1]
    distill = functools.partial(_distill, top1_weight=top1_weight)
    if method == "medusa":
        losses = [distill(lm(block(h[:, :S - i - 1])), logp[:, i + 1:])
                  for i, (block, lm) in enumerate(zip(head.blocks, head.lm_heads))]
        loss = sum(losses) / len(losses)
        return loss, {"loss": loss.item(), "kl_head0": losses[0].item()}
    if method == "mlp_speculator":
        state, losses = h[:, :S - head.n_predict], []
        for i in range(head.n_predict):
            n = S - head.n_predict
            state, logits = head.stage(i, state, x[:, i + 1:i + 1 + n])
            losses.append(distill(logits, logp[:, i + 1:i + 1 + n]))
        loss = sum(losses) / len(losses)
        return loss, {"loss": loss.item(), "kl_stage0": losses[0].item()}
    # eagle / eagle3 / mtp: pairs (state at t, token t+1) for t = 0..S-2
    if method == "eagle3":
        outs = unrolled_drafts(head, x, aux, pos, k)
        kls = [distill(head.draft_logits(out), logp[:, j + 1:]) for j, out in enumerate(outs)]
        loss = sum(kls) / len(kls)
        values = {"kl" if j == 0 else f"kl_step{j + 1}": kl.item() for j, kl in enumerate(kls)}
        return loss, values | {"loss": loss.item()}
    out = head(x[:, 1:], head.fuse_target(h[:, :-1]), pos[:, :-1], None, None)  # [B, S-1, H]
    loss = distill(head.logits(out), logp[:, 1:])
    values = {"kl": loss.item()}
    if method == "eagle":
        reg = F.smooth_l1_loss(out.float(), h[:, 1:].float())
        loss = loss * 0.1 + reg
        values["feature_l1"] = reg.item()
    return loss, values | {"loss": loss.item()}


def unrolled_drafts(head: nn.Module, x: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor,
                    k: int) -> list[torch.Tensor]:
    """An EAGLE-3 head unrolled for k draft steps over every position of x [B, S] at once (its
    training-time test): pass 0 reads the pairs (target aux state at t, token t+1); pass j feeds
    the head's own output of pass j-1 with token t+j+1, attending as the drafting chain would
    (`Attention._unrolled`). Returns k outputs; row t of output j [B, S-1-j, H] drafts token
    t+j+2, as the chain started after position t would."""
    earlier: list = []                       # keys and values of the passes so far
    tok = x[:, 1:]
    outs = [head(tok, head.fuse_target(aux[:, :-1]), pos[:, :-1], None, earlier)]
    for j in range(1, k):
        outs.append(head(tok[:, j:], outs[-1][:, :-1], pos[:, j:-1], None, earlier))
    return outs


# ---- writing the public formats -------------------------------------------------------------
def _fp(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in tensors.items()}


def _layer_tensors(layer: nn.Module, a: LlamaArgs, prefix: str) -> dict[str, torch.Tensor]:
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


def save_head(method: str, head: nn.Module, out: Path, target_dir: Path,
              dtype: torch.dtype = torch.bfloat16) -> None:
    out.mkdir(parents=True, exist_ok=True)
    a = getattr(head, "args", None)
    if method == "medusa":
        cfg = {"architectures": ["MedusaModel"], "num_heads": head.num_heads,
               "num_hidden_layers": len(head.blocks[0].layers),
               "hidden_size": head.lm_heads[0].in_features,
               "vocab_size": head.lm_heads[0].out_features, "original_lm_head": head.shared}
        tensors = {k: v for k, v in head.state_dict().items()
                   if not (head.shared and k.startswith("lm_heads."))}
    elif method == "mlp_speculator":
        cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
               "emb_dim": head.proj[0].in_features, "inner_dim": head.proj[0].out_features,
               "n_predict": head.n_predict, "vocab_size": head.head[0].out_features,
               "tie_weights": len(head.emb) == 1, "scale_input": head.ln0 is not None}
        tensors = dict(head.state_dict())
    elif method == "eagle":
        cfg = a.to_hf_config() | {"num_hidden_layers": 1}
        tensors = {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias}
        tensors |= _layer_tensors(head.layers[0], a, "layers.0.")
    elif method == "eagle3":
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "draft_vocab_size": head.lm_head.out_features,
               "target_hidden_size": head.fc.in_features // 3,
               "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
               "transformer_layer_config": a.to_hf_config() | {"num_hidden_layers": 1}}
        tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight,
                   "lm_head.weight": head.lm_head.weight, "d2t": head.d2t}
        tensors |= _layer_tensors(head.layers[0], a, "layers.0.")
    elif method == "mtp":
        # The target directory plus its MTP layer as one more shard. The target's weight shards
        # are relative symlinks, not copies: the MTP layer is small, the target is not
        # (`cp -rL` makes a self-contained copy).
        for f in target_dir.iterdir():
            if f.name == "model-mtp.safetensors" or not f.is_file():
                continue
            dst = out / f.name
            dst.unlink(missing_ok=True)
            if f.suffix == ".safetensors":
                dst.symlink_to(os.path.relpath(f.resolve(), out.resolve()))
            elif f.suffix == ".json":
                shutil.copy(f, dst)
        cfg = json.loads((target_dir / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
        p = f"model.layers.{cfg['num_hidden_layers']}."     # MTP layers follow the decoder
        tensors = {p + "enorm.weight": head.enorm.weight, p + "hnorm.weight": head.hnorm.weight,
                   p + "eh_proj.weight": head.eh_proj.weight,
                   p + "shared_head.norm.weight": head.shared_head_norm.weight}
        tensors |= _layer_tensors(head.block, a, p)
        _add_shard(out, _fp(tensors, dtype))
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return
    else:
        raise ValueError(method)
    save_file(_fp(tensors, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _add_shard(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to a model directory as an extra safetensors shard (index updated)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        single = model_dir / "model.safetensors"
        from safetensors import safe_open
        with safe_open(str(single), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: single.name for k in f.keys()}}
    name = "model-mtp.safetensors"
    save_file(tensors, str(model_dir / name), metadata={"format": "pt"})
    index["weight_map"].update({k: name for k in tensors})
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def evaluate_tau(target_dir: Path, head_dir: Path, method: str, k: int, num_prompts: int = 8,
                 max_tokens: int = 96) -> dict:
    """Mean acceptance length at K, greedy, on held-out code prompts."""
    from specserve import LLM, SamplingParams
    from specserve.bench.prompts import completion_prompts
    spec = {"method": method, "num_speculative_tokens": k}
    if method != "mtp":
        spec["model"] = str(head_dir)
    llm = LLM(str(head_dir if method == "mtp" else target_dir), device="cpu",
              speculative_config=spec)
    max_tokens = min(max_tokens, llm.engine.max_model_len // 2)
    llm.generate(fit_prompts(llm, completion_prompts(num_prompts), max_tokens), SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    m = llm.get_metrics()
    d = max(1, m["spec_decode_num_drafts"])
    return {"tau": m["mean_acceptance_length"], "acceptance_rate": m["acceptance_rate"],
            "per_position": [a / d for a in m["spec_decode_num_accepted_tokens_per_pos"]]}


def train_head(method: str, cfg: TrainConfig, target_dir: Path, out: Path, k: int = 4,
               gen: GeneratedData | None = None, corpus: Corpus | None = None,
               draft_vocab: int | None = None, init: Path | None = None,
               refresh_vocab: bool = False) -> dict:
    """Train a head for `target_dir` (starting from the head in `init` when given), write it to
    `out`, return its tau evaluation."""
    return train_heads({method: out}, cfg, target_dir, k, gen, corpus, draft_vocab,
                       {method: init} if init else None, refresh_vocab)[method]


def train_heads(outs: dict[str, Path], cfg: TrainConfig, target_dir: Path, k: int = 4,
                gen: GeneratedData | None = None, corpus: Corpus | None = None,
                draft_vocab: int | None = None,
                inits: dict[str, Path] | None = None,
                refresh_vocab: bool = False) -> dict[str, dict]:
    """Train a head of each method in `outs` (method -> output directory) on the same batches,
    write each in its format, return each one's tau evaluation ({} while unfinished; a
    "skipped" note where the checkpoint is already past this schedule). A method in `inits`
    starts from that trained head (one trained for an earlier version of the target, say)
    instead of fresh weights (with `refresh_vocab`, an eagle3 head in `inits` moves to this
    run's draft vocabulary: `_remap_vocab`); a checkpoint in the work directory still wins. Several
    methods share each step's target pass (medusa, mlp_speculator, eagle, mtp: the heads that
    read its last hidden state); the gradient-clipping norm grows with sqrt(number of heads), so
    each head is clipped about as it would be alone."""
    methods = list(outs)
    if len(methods) > 1 and "eagle3" in methods:
        raise ValueError("eagle3 reads other target layers and its own vocabulary: train it alone")
    device = _setup(cfg)
    corpus = corpus or Corpus.stdlib()
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(target_dir, torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    train_ids, _, _ = prepare_data(target_dir, work, corpus, 0)
    ids = with_generated(train_ids, gen or GeneratedData(), target_dir, corpus, work, cfg.seed)
    counts = np.bincount(ids, minlength=target.args.vocab_size)
    heads = nn.ModuleDict({m: build_head(m, target, k, draft_vocab, counts) for m in methods})
    for m, d in (inits or {}).items():
        _init_from(heads[m], m, Path(d), target, refresh_vocab)
    heads.to(device)
    for m, head in heads.items():
        print(f"{m} head: {sum(p.numel() for p in head.parameters() if p.requires_grad) / 1e6:.2f}M "
              f"trainable parameters; {len(ids) / 1e6:.2f}M training tokens", flush=True)
    if len(methods) == 1:        # the head alone: its checkpoint keys stay the head's own
        model = heads[methods[0]]
        loss_fn = head_loss(methods[0], model, target, k, cfg.top1_weight)
    else:
        model, loss_fn = heads, joint_head_loss(heads, target, k, cfg.top1_weight)
        cfg = dataclasses.replace(cfg, grad_clip=cfg.grad_clip * len(methods) ** 0.5)
    log = train(model, ids, cfg, device, loss_fn)
    if not log or log[-1]["step"] < cfg.steps:
        return {m: {} for m in methods}                  # stopped early: resume to finish
    if log[-1]["step"] > cfg.steps:                      # a later stage went past this one
        return {m: {"skipped": f"the checkpoint in {work} is at step {log[-1]['step']}, past "
                               f"this stage's {cfg.steps}"} for m in methods}
    results = {}
    for m, out in outs.items():
        save_head(m, heads[m], out, target_dir)
        results[m] = evaluate_tau(target_dir, out, m, k)
        (out / "quality.json").write_text(json.dumps({"method": m, "k": k, **results[m],
                                                      "train_steps": cfg.steps}, indent=2) + "\n")
    return results
