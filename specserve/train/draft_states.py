"""`specserve train draft|pard --hidden-states DIR`: a draft model for a real target, learnt from
the target's own answers (`specserve train chat-data`) instead of corpus text.

The files hold each conversation's tokens and the target's last hidden state at every position,
so the target's next-token distribution is its lm_head over those states: no target pass per
step, which is most of a small draft's training step on a real target. The draft has the target's
tokenizer (written beside it, from the GGUF where the target is one); a fresh draft starts its
tied embedding from the target's, projected on its principal directions (the target's
own output space, so that the first steps learn context rather than the vocabulary). With
`pard_k` the loss is PARD's (`pard_loss`): the draft still drafts one token per pass as copy 0
and K in one pass with `parallel_drafting`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from specserve.methods.parallel import unused_token
from specserve.models.gguf import gguf_path, open_gguf
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model, save_model
from specserve.train.heads import evaluate_tau
from specserve.train.lm import TOKENIZER_FILES, ModelShape, _setup, init_weights
from specserve.train.pard import pard_loss
from specserve.train.states import read_hidden_states, state_batches
from specserve.train.trainer import TrainConfig, bf16_autocast, lm_loss, train


def embedding_from_target(model: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Set the draft's embedding [V, h] to the target's [V, H] projected on its h principal
    directions (scaled to the target's per-entry spread), so that the tied lm_head starts as the
    target's restricted to those directions."""
    e = target.embed_tokens.weight.detach().float()                      # [V, H]
    h = model.args.hidden_size
    if h > e.shape[1]:
        raise ValueError(f"the draft ({h} wide) is wider than the target ({e.shape[1]}): give a "
                         "smaller --hidden-size")
    _, vecs = torch.linalg.eigh(e.T @ e)                                      # ascending
    proj = e @ vecs[:, -h:].flip(1)                                            # [V, h]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(proj * (e.std() / proj.std()))


def write_tokenizer(target_dir: Path, out: Path) -> int | None:
    """The target's tokenizer files in `out` (from the GGUF's own vocabulary where the target is
    one); returns its end-of-sequence id."""
    if (g := gguf_path(target_dir)) is not None:
        gguf = open_gguf(g)
        tok, config = gguf.tokenizer()
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(
            {k: v for k, v in config.items() if v is not None}, indent=2) + "\n")
        return gguf.hf_config.get("eos_token_id")
    for f in TOKENIZER_FILES:
        if (target_dir / f).is_file():
            shutil.copy(target_dir / f, out / f)
    return json.loads((target_dir / "config.json").read_text()).get("eos_token_id")


def chat_tau(target_dir: Path, draft: Path, ks: list[int], extra: dict | None = None
             ) -> dict[str, dict[str, float]]:
    """tau per K on the held-out chat prompts, greedy and at temperature 0.7 (as the heads'
    quality.json reports it)."""
    def tau(k: int, t: float) -> float:
        return round(evaluate_tau(target_dir, draft, "draft_model", k, 16, 128, extra, True,
                                  t)["tau"], 3)
    return {f"temperature {t}": {str(k): tau(k, t) for k in ks} for t in (0.0, 0.7)}


def train_draft_on_states(cfg: TrainConfig, shape: ModelShape, target_dir: Path, out: Path,
                          hidden_states: Path | Sequence[Path], init: Path | None = None,
                          pard_k: int | None = None, depth_gamma: float | None = None,
                          eval_k: int = 4) -> dict:
    """Train a draft of `shape` (or continue the one in `init`) for `target_dir` on the files in
    `hidden_states`, write it to `out` with its quality.json (tau per K, chained, and with
    `pard_k` also parallel) and return that; {} when stopped on the time limit."""
    if pard_k is not None and pard_k < 2:
        raise ValueError(f"--num-speculative-tokens must be >= 2 for PARD (got {pard_k})")
    device = _setup(cfg)
    target = load_model(target_dir, torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    states, _ = read_hidden_states(
        hidden_states, torch.bfloat16 if bf16_autocast(cfg, device) else None)
    ids = torch.cat([d["token_ids"] for d in states]).numpy()
    vocab = target.args.vocab_size
    if init is not None:
        model = load_model(init, torch.float32, device)
        if model.args.vocab_size != vocab:
            raise ValueError(f"{init}: the draft's vocabulary ({model.args.vocab_size}) is not "
                             f"the target's ({vocab})")
    else:
        model = LlamaForCausalLM(shape.args(vocab))
        init_weights(model, cfg.seed)
        embedding_from_target(model, target)
    mask_id = unused_token(ids, vocab) if pard_k else None
    loss = (pard_loss(model, target, pard_k, mask_id, cfg.kd_alpha, depth_gamma,
                      cfg.top1_weight) if pard_k else lm_loss(model, target, cfg.kd_alpha))
    print(f"draft: {model.num_parameters() / 1e6:.2f}M parameters; {len(ids) / 1e6:.2f}M "
          f"training tokens" + (f"; PARD, K = {pard_k}, mask token {mask_id}" if pard_k else ""),
          flush=True)
    log = train(model, None, cfg, device, loss, batches=state_batches(states, cfg, device))
    if not log or log[-1]["step"] < cfg.steps:
        return {}
    save_model(model, out, dtype=torch.bfloat16)
    eos = write_tokenizer(target_dir, out)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "do_sample": False}, indent=2) + "\n")
    work = Path(cfg.work_dir)
    for f in ("loss.png", "train_log.jsonl"):
        shutil.copy(work / f, out / f)
    if pard_k:
        config = json.loads((out / "config.json").read_text())
        config |= {"pard_token": mask_id, "spd_type": "pard", "pard_k": pard_k}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ks = list(range(1, eval_k + 1))
    quality = {"parameters": model.num_parameters(), "train_steps": cfg.steps,
               "training_tokens": len(ids), "tau_per_k": chat_tau(target_dir, out, ks)}
    if pard_k:
        quality["tau_per_k_parallel"] = chat_tau(target_dir, out, ks[1:],
                                                 {"parallel_drafting": True})
    (out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    return quality

