"""`specserve train unlikelihood`: fine-tune a language model so that its greedy output stops
looping, by sequence-level unlikelihood training (Welleck et al., 2019, "Neural Text
Generation with Unlikelihood Training").

Every step the model greedily continues the openings of its corpus batch (on-policy, with a KV
cache), marks the continuation tokens that belong to an n-gram (default 8) already seen earlier
in the same continuation, and adds `-log(1 - p(token))` at those tokens to the usual next-token
cross-entropy on the corpus batch. Cross-entropy keeps the model's distribution; the
unlikelihood term removes probability from exactly the repeats greedy decoding falls into.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.data.corpus import Corpus
from specserve.kv_cache import KVCache
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model
from specserve.models.metadata import ragged_inputs
from specserve.train.lm import _setup, prepare_data, train_and_export
from specserve.train.trainer import LossFn, TrainConfig, _positions


@dataclass
class UnlikelihoodConfig:
    ul_weight: float = field(default=1.0, metadata={
        "help": "unlikelihood: weight of the repeat penalty against cross-entropy"})
    prefix_len: int = field(default=64, metadata={
        "help": "unlikelihood: tokens of each corpus window the model continues"})
    rollout_len: int = field(default=96, metadata={
        "help": "unlikelihood: greedy tokens generated per window each step"})
    # 8, not 4: 4-gram repeats include the short ones code is made of (indentation, `self.`),
    # and penalising those flattened the target's distribution until drafters could not
    # predict it.
    ngram: int = field(default=8, metadata={
        "help": "unlikelihood: a token is a repeat when it is part of an n-gram seen earlier "
                "in the same continuation"})

    def __post_init__(self) -> None:
        if self.ul_weight < 0 or min(self.prefix_len, self.rollout_len, self.ngram) < 1:
            raise ValueError("ul_weight must be >= 0 and prefix_len, rollout_len, ngram >= 1")


def repeat_mask(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """tokens [B, L] -> bool [B, L]: True at every token of an n-gram that already occurred
    earlier in the same row."""
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    for b, row in enumerate(tokens.tolist()):
        seen: set[tuple[int, ...]] = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1:t + 1])
            if gram in seen:
                mask[b, t - n + 1:t + 1] = True
            seen.add(gram)
    return mask.to(tokens.device)


@torch.no_grad()
def greedy_rollouts(model: LlamaForCausalLM, prefixes: torch.Tensor, length: int) -> torch.Tensor:
    """Greedy continuations of `prefixes` [B, P] by `model`, with a KV cache: [B, length]."""
    B, P = prefixes.shape
    a = model.args
    p = next(model.parameters())
    cache = KVCache(a.num_hidden_layers, B, a.num_key_value_heads, P + length, a.head_dim,
                    torch.float32, p.device)
    slots = list(range(B))
    feed = prefixes.tolist()
    starts = [0] * B
    out = []
    with torch.autocast(p.device.type, enabled=False):
        for _ in range(length):
            ids, positions, md = ragged_inputs(feed, starts, slots, p.device)
            hidden = model(ids, positions, md, cache.layers)                 # [T, H]
            last = torch.tensor([len(f) for f in feed], device=p.device).cumsum(0) - 1
            nxt = model.compute_logits(hidden[last]).argmax(-1)               # [B]
            out.append(nxt)
            starts = [s + len(f) for s, f in zip(starts, feed)]
            feed = [[t] for t in nxt.tolist()]
    return torch.stack(out, dim=1)                                           # [B, length]


def unlikelihood_loss(model: LlamaForCausalLM, ul: UnlikelihoodConfig) -> LossFn:
    """Cross-entropy on the corpus batch + ul_weight * unlikelihood of the repeated tokens of
    the model's own greedy continuations of the batch's openings."""
    def fn(xy: torch.Tensor):
        x, y = xy[:, :-1], xy[:, 1:]
        logits = model.compute_logits(model(x, _positions(x))).float()      # [B, S, V]
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        prefix = xy[:, :ul.prefix_len]
        cont = greedy_rollouts(model, prefix, ul.rollout_len)                # [B, L]
        mask = repeat_mask(cont, ul.ngram)                                   # [B, L]
        seq = torch.cat([prefix, cont], dim=1)[:, :-1]                       # [B, P + L - 1]
        lp = F.log_softmax(model.compute_logits(model(seq, _positions(seq))).float(), -1)
        lp = lp[:, ul.prefix_len - 1:].gather(-1, cont[..., None]).squeeze(-1)  # [B, L]
        one_minus_p = (-torch.expm1(lp)).clamp_min(1e-5)
        ul_term = -(torch.log(one_minus_p) * mask).sum() / mask.numel()
        return ce + ul.ul_weight * ul_term, {
            "loss": ce.item(), "ul": ul_term.item(), "repeat_share": mask.float().mean().item()}
    return fn


def train_unlikelihood(cfg: TrainConfig, ul: UnlikelihoodConfig, model_dir: Path, out: Path,
                       corpus: Corpus | None = None) -> float:
    """Fine-tune the model in `model_dir` with unlikelihood on its repeats; returns its
    validation bits per byte (NaN when stopped on the time limit)."""
    if ul.prefix_len >= cfg.seq_len:
        raise ValueError(f"prefix_len ({ul.prefix_len}) must be shorter than seq_len "
                         f"({cfg.seq_len})")
    device = _setup(cfg)
    work = Path(cfg.work_dir)
    model = load_model(model_dir, torch.float32, device)
    if ul.prefix_len + ul.rollout_len > model.args.max_position_embeddings:
        raise ValueError("prefix_len + rollout_len exceeds the model's context "
                         f"({model.args.max_position_embeddings})")
    train_ids, val_ids, val_bytes = prepare_data(model_dir, work, corpus or Corpus.stdlib(), 0)
    work.mkdir(parents=True, exist_ok=True)
    (work / "unlikelihood_config.json").write_text(json.dumps(ul.__dict__, indent=2))
    return train_and_export(model, train_ids, (val_ids, val_bytes), cfg, device,
                            unlikelihood_loss(model, ul), model_dir, out)

