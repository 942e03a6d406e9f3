"""`specserve train pard`: adapt a draft model to parallel drafting (PARD, arXiv 2504.18583).

At inference a PARD draft reads the verified context followed by K-1 copies of a mask token
and predicts a token at every one of those positions. Training shows it exactly that: each
sequence x[0..L) is followed by K-1 all-mask copies that reuse positions 0..L-1, and copy k's
row at position j sees the real tokens 0..j-k and one mask of each copy 1..k (copy m at
position j-k+m), which is what mask k sees at inference when the context ends at j-k. Every
row predicts x[j+1]. The draft learns from the target: KL to the target's next-token
distribution at j (one target pass serves all copies), blended with cross-entropy as `train
draft` does, on the same corpus plus target-generated text.

The mask token is an id the tokenizer never produced on the training text; it is written to
the draft's config.json as `pard_token` (PARD's key, which vLLM also reads).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.data.corpus import Corpus
from specserve.methods.parallel import depth_weights, pard_mask, unused_token
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model
from specserve.train.generated import GeneratedData, with_generated
from specserve.train.heads import evaluate_tau
from specserve.train.lm import _setup, prepare_data, train_and_export
from specserve.train.trainer import LossFn, TrainConfig, _positions, batch_tokens, target_logits


def pard_loss(model: LlamaForCausalLM, teacher: LlamaForCausalLM, k: int, mask_id: int,
              kd_alpha: float, depth_gamma: float | None = None, top1_weight: float = 0.0
              ) -> LossFn:
    """kd_alpha * KL(target || draft) + (1 - kd_alpha) * CE over the real rows and the k-1 mask
    copies of a batch [B, L + 1]; copy c's first c rows have no real context and are skipped.
    `top1_weight` adds to the KL a cross-entropy to the target's most likely token (the only
    draft greedy verification accepts), as the heads' recipes do.
    With `depth_gamma`, copy c's rows weigh exp(-c / depth_gamma) (as DFlash weighs its block
    positions): a small draft spends its capacity on the drafts that are accepted; PARD's own
    recipe weighs all copies alike."""
    layouts: dict[int, tuple[torch.Tensor, ...]] = {}          # per length: see layout()

    def layout(L: int, device: torch.device):
        """The attention mask, which rows count ([k, L] bool), the copy of each counted row
        [n] and its weight [n] (summing to 1)."""
        if L not in layouts:
            j, c = torch.arange(L, device=device), torch.arange(k, device=device)
            valid = j[None, :] >= c[:, None]
            copy = c[:, None].expand(k, L)[valid]
            w = depth_weights(k, depth_gamma, device)[copy]
            layouts[L] = pard_mask(L, k, device), valid, copy, w / w.sum()
        return layouts[L]

    def fn(batch):
        xy = batch_tokens(batch)
        x, y = xy[:, :-1], xy[:, 1:]                                      # [B, L]
        B, L = x.shape
        mask, valid, copy, w = layout(L, x.device)                       # w: [n], sums to 1
        inputs = torch.cat([x, x.new_full((B, (k - 1) * L), mask_id)], 1)   # [B, k * L]
        positions = _positions(x).repeat(1, k)
        logits = model.compute_logits(model(inputs, positions, mask=mask)).float()
        rows = logits.view(B, k, L, -1)[:, valid]                          # [B, n, V]
        labels = y[:, None, :].expand(B, k, L)[:, valid]                   # [B, n]
        logp = F.log_softmax(rows, -1)
        nll = -logp.gather(-1, labels[..., None]).squeeze(-1)              # [B, n]
        ce = (nll * w).sum() / B
        with torch.no_grad():
            t_logp = F.log_softmax(target_logits(teacher, batch), -1)       # [B, L, V]
        t_rows = t_logp[:, None].expand(B, k, L, -1)[:, valid]             # [B, n, V]
        kl_rows = F.kl_div(logp, t_rows, log_target=True, reduction="none").sum(-1)  # [B, n]
        if top1_weight:
            top1 = t_logp.argmax(-1)[:, None, :].expand(B, k, L)[:, valid]     # [B, n]
            kl_rows = kl_rows - top1_weight * logp.gather(-1, top1[..., None]).squeeze(-1)
        kl = (kl_rows * w).sum() / B
        return kd_alpha * kl + (1 - kd_alpha) * ce, {
            "loss": ce.item(), "kl": kl.item(), "ce_copy0": nll[:, copy == 0].mean().item(),
            "ce_last": nll[:, copy == k - 1].mean().item()}
    return fn


def train_pard(cfg: TrainConfig, draft_dir: Path, target_dir: Path, out: Path, k: int = 8,
               corpus: Corpus | None = None, gen: GeneratedData | None = None,
               depth_gamma: float | None = None) -> float:
    """Adapt the draft in `draft_dir` to draft k tokens per pass; writes a PARD draft to `out`
    (config.json with `pard_token`) and returns its validation bits per byte (as an ordinary
    LM; NaN when stopped on the time limit)."""
    if k < 2:
        raise ValueError(f"--num-speculative-tokens must be >= 2 for PARD (got {k}): one "
                         "draft per pass is what the draft already does")
    device = _setup(cfg)
    work = Path(cfg.work_dir)
    teacher = load_model(target_dir, torch.float32, device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    model = load_model(draft_dir, torch.float32, device)
    if model.args.vocab_size != teacher.args.vocab_size:
        raise ValueError(f"--draft {draft_dir}: its vocabulary ({model.args.vocab_size}) is not "
                         f"the target's ({teacher.args.vocab_size})")
    corpus = corpus or Corpus.stdlib()
    train_ids, val_ids, val_bytes = prepare_data(target_dir, work, corpus, 0)
    mask_id = unused_token(train_ids, model.args.vocab_size)
    if gen is not None:
        train_ids = with_generated(train_ids, gen, target_dir, corpus, work, cfg.seed)
    print(f"pard: {model.num_parameters() / 1e6:.2f}M-parameter draft, K = {k}, mask token "
          f"{mask_id}", flush=True)
    bpb = train_and_export(model, train_ids, (val_ids, val_bytes), cfg, device,
                           pard_loss(model, teacher, k, mask_id, cfg.kd_alpha, depth_gamma,
                                     cfg.top1_weight),
                           target_dir, out)
    if bpb != bpb:
        return bpb
    config = json.loads((out / "config.json").read_text())
    config |= {"pard_token": mask_id, "spd_type": "pard", "pard_k": k}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    quality = json.loads((out / "quality.json").read_text())
    quality["tau"] = {n: evaluate_tau(target_dir, out, "draft_model", n,
                                      extra={"parallel_drafting": True})
                      for n in sorted({2, 4, k})}
    (out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    print(json.dumps({n: round(q["tau"], 3) for n, q in quality["tau"].items()}), flush=True)
    return bpb
