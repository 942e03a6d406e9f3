"""`specserve train {eagle,eagle3,medusa,mlp_speculator,mtp,dflash}`: train a draft head for a
target.

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
  drafts were never trained); with `--parallel` (P-EAGLE) one pass with K-1 mask copies
  instead (`parallel_drafts`);
- mtp: the MTP layer over (h_t, x_t+1) vs the target at t+1;
- dflash: blocks [x_a, mask...] at random anchors a, seeing the fused target states before a,
  vs the target at a+1..a+B-1, weighted along the block.
The result is written in the public format the loader reads, then tau is measured on held-out
prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specserve import methods
from specserve.data.chat_prompts import chat_prompts
from specserve.data.corpus import Corpus
from specserve.data.prompts import completion_prompts
from specserve.llm import LLM
from specserve.models.loader import load_model
from specserve.sampling_params import SamplingParams
from specserve.train.generated import GeneratedData, fit_prompts, with_generated
from specserve.train.lm import _setup, prepare_data
from specserve.train.states import read_hidden_states, state_batches
from specserve.train.trainer import TrainConfig, _positions, bf16_autocast, train


def build_head(method: str, target, k: int, draft_vocab: int | None = None,
               token_counts: np.ndarray | None = None, **options) -> nn.Module:
    """A fresh head of `method` for `target` (eagle3 may keep a reduced draft vocabulary: the
    `draft_vocab` ids most frequent in `token_counts` [V]; `options`: the method's own shape
    settings, dflash's block_size and num_layers)."""
    spec = methods.get(method)
    if spec.new_head is None:
        raise ValueError(f"{method!r} has no head to train; choose from "
                         f"{', '.join(methods.head_methods())}")
    return spec.new_head(target, k, draft_vocab, token_counts, **options)


def _init_from(head: nn.Module, method: str, d: Path, target,
               refresh_vocab: bool = False) -> None:
    """Copy the trained head in `d` into `head` (built for this run's shape); any mismatch (a
    different K, draft vocabulary or width) is an error that names it; a chain head grows a
    fresh P-EAGLE mask state, a P-EAGLE head trained as a chain drops its own. With
    `refresh_vocab` (eagle3) `head` keeps the draft vocabulary it was built with (this run's
    most frequent tokens, of any size): see `_remap_vocab`."""
    if refresh_vocab and not hasattr(head, "d2t"):
        raise ValueError("refreshing the draft vocabulary applies to heads with one (eagle3)")
    loaded = methods.get(method).read(d, target)
    trained = loaded.state_dict()
    if refresh_vocab:
        trained = _remap_vocab(trained, head.d2t, target.lm_head.weight)
    own = head.state_dict()
    if "mask_hidden" in own and "mask_hidden" not in trained:   # a chain head becomes P-EAGLE
        trained = {**trained, "mask_hidden": own["mask_hidden"]}
    elif "mask_hidden" in trained and "mask_hidden" not in own:  # a P-EAGLE head, as a chain
        trained = {k: v for k, v in trained.items() if k != "mask_hidden"}
    elif getattr(loaded, "mask_token_id", None) is not None:
        head.mask_token_id = loaded.mask_token_id
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
    target_lm_head = target_lm_head.detach().to(rows.device)
    scale = rows[ref].norm(dim=1).mean() / target_lm_head[old_ids[ref]].norm(dim=1).mean()
    lm = target_lm_head[new_ids] * scale                                       # [n, H]
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


def _draft_vocab(head: nn.Module) -> torch.Tensor | None:
    """The target token ids of a head's draft vocabulary (eagle3), over which it learns the
    target's distribution; None for a head that drafts over the full vocabulary."""
    return head.draft_to_target() if hasattr(head, "draft_to_target") else None


def _target_logp(target, hidden: torch.Tensor,
                 vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The frozen target's next-token log-probabilities [..., V] from its final hidden states,
    over `vocab_ids` only when given. Then only those lm_head rows are multiplied: a 4,096-token
    draft vocabulary is a twelfth of SmolLM2's 49,152, and the KL over it reads no other row."""
    lm_head = target.lm_head
    if vocab_ids is not None and type(lm_head) is nn.Linear:
        logits = F.linear(hidden, lm_head.weight[vocab_ids])                # [..., V]
    else:
        logits = target.compute_logits(hidden)                              # [..., vocab]
        if vocab_ids is not None:
            logits = logits[..., vocab_ids]
    return F.log_softmax(logits.float(), -1)


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
        return pos, h, aux, _target_logp(target, h, vocab_ids)


def head_loss(method: str, head: nn.Module, target, k: int, top1_weight: float = 0.0):
    """Loss function over a token batch [B, S + 1] (see the module docstring); eagle3 is
    unrolled for the k draft steps it serves at K = k. top1_weight: see `_distill`."""
    aux_layers = tuple(getattr(head, "aux_layers", ()))

    def fn(xy: torch.Tensor):
        x = xy[:, :-1]                                                     # [B, S]
        return _method_loss(method, head, x,
                            *_target_pass(target, x, aux_layers, _draft_vocab(head)), k,
                            top1_weight)
    return fn


def state_loss(method: str, head: nn.Module, target, k: int, top1_weight: float = 0.0):
    """head_loss over a batch of extracted hidden states (`state_batches`) instead of a target
    pass: the states and the target's distribution come from the files. A window's states saw
    the request from its start (as when serving), not the window alone."""
    def fn(b: dict[str, torch.Tensor]):
        x = b["xy"][:, :-1]                                                # [B, S]
        vocab = _draft_vocab(head)
        with torch.no_grad():
            logp = _target_logp(target, b["hidden"], vocab)
        return _method_loss(method, head, x, b["positions"], b["hidden"], b["aux_hidden"], logp,
                            k, top1_weight)
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
    distill = functools.partial(_distill, top1_weight=top1_weight)
    return methods.get(method).loss(head, x, pos, h, aux, logp, k, distill)


def save_head(method: str, head: nn.Module, out: Path, target_dir: Path,
              dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `head` in its method's public format (the one the engine reads)."""
    methods.get(method).write(head, out, target_dir, dtype)


def evaluate_tau(target_dir: Path, head_dir: Path, method: str, k: int, num_prompts: int = 8,
                 max_tokens: int = 96, extra: dict | None = None, chat: bool = False,
                 temperature: float = 0.0, pool: str = "base") -> dict:
    """Mean acceptance length at K on held-out prompts: code completions, or with `chat` the
    held-out chat prompts of `pool` through the target's chat template (`extra`: more
    speculative_config keys)."""
    spec = {"method": method, "num_speculative_tokens": k, "model": str(head_dir)} | (extra or {})
    llm = LLM(str(target_dir), device="cpu", speculative_config=spec)
    max_tokens = min(max_tokens, llm.engine.max_model_len // 2)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0,
                            ignore_eos=not chat)
    if chat:
        prompts = chat_prompts("heldout", pool=pool)[:num_prompts]
        llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        llm.generate(fit_prompts(llm, completion_prompts(num_prompts), max_tokens), params,
                     use_tqdm=False)
    m = llm.get_stats()
    d = max(1, m["spec_decode_num_drafts"])
    return {"tau": m["mean_acceptance_length"], "acceptance_rate": m["acceptance_rate"],
            "per_position": [a / d for a in m["spec_decode_num_accepted_tokens_per_pos"]]}


def train_head(method: str, cfg: TrainConfig, target_dir: Path, out: Path, k: int = 4,
               gen: GeneratedData | None = None, corpus: Corpus | None = None,
               draft_vocab: int | None = None, init: Path | None = None,
               refresh_vocab: bool = False, hidden_states: Path | Sequence[Path] | None = None,
               head_options: dict | None = None, chat: bool = False) -> dict:
    """Train a head for `target_dir` (starting from the head in `init` when given), write it to
    `out`, return its tau evaluation. With `hidden_states`, on the files `extract_hidden_states`
    wrote there (one directory or several) instead of corpus text; with `chat`, tau is measured
    on the held-out chat prompts (per K, greedy and sampled) instead of code completions."""
    return train_heads({method: out}, cfg, target_dir, k, gen, corpus, draft_vocab,
                       {method: init} if init else None, refresh_vocab, hidden_states,
                       head_options, chat)[method]


def train_heads(outs: dict[str, Path], cfg: TrainConfig, target_dir: Path, k: int = 4,
                gen: GeneratedData | None = None, corpus: Corpus | None = None,
                draft_vocab: int | None = None,
                inits: dict[str, Path] | None = None,
                refresh_vocab: bool = False,
                hidden_states: Path | Sequence[Path] | None = None,
                head_options: dict | None = None, chat: bool = False) -> dict[str, dict]:
    """Train a head of each method in `outs` (method -> output directory) on the same batches,
    write each in its format, return each one's tau evaluation ({} while unfinished; a
    "skipped" note where the checkpoint is already past this schedule). A method in `inits`
    starts from that trained head (one trained for an earlier version of the target, say)
    instead of fresh weights (with `refresh_vocab`, an eagle3 head in `inits` moves to this
    run's draft vocabulary: `_remap_vocab`); a checkpoint in the work directory still wins. Several
    methods share each step's target pass (medusa, mlp_speculator, eagle, mtp: the heads that
    read its last hidden state); the gradient-clipping norm grows with sqrt(number of heads), so
    each head is clipped about as it would be alone."""
    names = list(outs)
    device = _setup(cfg)
    corpus = corpus or Corpus.stdlib()
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(target_dir, torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    if hidden_states is not None:              # served traffic's states, no target pass
        states, layers = read_hidden_states(
            hidden_states, torch.bfloat16 if bf16_autocast(cfg, device) else None)
        ids = torch.cat([d["token_ids"] for d in states]).numpy()
    else:
        train_ids, _, _ = prepare_data(target_dir, work, corpus, 0)
        ids = with_generated(train_ids, gen or GeneratedData(), target_dir, corpus, work,
                             cfg.seed)
    counts = np.bincount(ids, minlength=target.args.vocab_size)
    if hidden_states is not None and names == ["dflash"]:      # fc reads what the files hold
        head_options = {"num_target_layers": len(layers), **(head_options or {})}
    heads = nn.ModuleDict({m: build_head(m, target, k, draft_vocab, counts,
                                         **(head_options or {})) for m in names})
    if hidden_states is not None:
        if len(names) > 1:
            raise ValueError("--hidden-states trains one head at a time")
        if hasattr(heads[names[0]], "aux_layers"):         # the layers the files hold
            heads[names[0]].aux_layers = layers
    if len(names) > 1 and any(hasattr(h, "aux_layers") or hasattr(h, "d2t")
                              for h in heads.values()):
        raise ValueError("a head that reads other target layers or has its own vocabulary "
                         "(eagle3): train it alone")
    for m, d in (inits or {}).items():
        _init_from(heads[m], m, Path(d), target, refresh_vocab)
    heads.to(device)
    for m, head in heads.items():
        print(f"{m} head: {sum(p.numel() for p in head.parameters() if p.requires_grad) / 1e6:.2f}M "
              f"trainable parameters; {len(ids) / 1e6:.2f}M training tokens", flush=True)
    batches = None
    if hidden_states is not None:
        model = heads[names[0]]
        loss_fn = state_loss(names[0], model, target, k, cfg.top1_weight)
        batches = state_batches(states, cfg, device)
    elif len(names) == 1:        # the head alone: its checkpoint keys stay the head's own
        model = heads[names[0]]
        loss_fn = head_loss(names[0], model, target, k, cfg.top1_weight)
    else:
        model, loss_fn = heads, joint_head_loss(heads, target, k, cfg.top1_weight)
        cfg = dataclasses.replace(cfg, grad_clip=cfg.grad_clip * len(names) ** 0.5)
    log = train(model, ids, cfg, device, loss_fn, batches=batches)
    if not log or log[-1]["step"] < cfg.steps:
        return {m: {} for m in names}                  # stopped early: resume to finish
    if log[-1]["step"] > cfg.steps:                      # a later stage went past this one
        return {m: {"skipped": f"the checkpoint in {work} is at step {log[-1]['step']}, past "
                               f"this stage's {cfg.steps}"} for m in names}
    results = {}
    for m, out in outs.items():
        save_head(m, heads[m], out, target_dir)
        parallel = getattr(heads[m], "mask_hidden", None) is not None        # P-EAGLE
        extra = {"parallel_drafting": True} if parallel else None
        results[m] = evaluate_tau(target_dir, out, m, k, extra=extra, chat=chat)
        if chat:        # tau per K, greedy and sampled, on the held-out chat prompts
            # a P-EAGLE head chains too (its copy 0 drafts the next token as EAGLE-3's does):
            # "tau_per_k" is the chain, "tau_per_k_parallel" one pass, as for a PARD draft
            modes = {"tau_per_k": None} | ({"tau_per_k_parallel": extra} if parallel else {})
            for key, ex in modes.items():
                results[m][key] = {f"temperature {t}": {
                    kk: round(evaluate_tau(target_dir, out, m, kk, 16, 128, ex, True, t)["tau"],
                              3) for kk in range(1, k + 1)} for t in (0.0, 0.7)}
        (out / "quality.json").write_text(json.dumps({"method": m, "k": k, **results[m],
                                                      "train_steps": cfg.steps}, indent=2) + "\n")
    return results
