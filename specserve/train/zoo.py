"""`specserve zoo build`: the whole recipe of the bundled models, seeded and resumable.

Stages (each resumes from its checkpoint in `<work>/`):
1. byte-level BPE tokenizer (8192 tokens) on the stdlib training files;
2. the target: 22M-parameter Llama, 2600 steps x 8 x 512 tokens (about 1.25 epochs), resumed
   to 5200 steps (`TARGET_STAGES`), then 100 steps of unlikelihood training against its own
   greedy 8-gram repeats (`TARGET_UL[0]`);
3. a 2.4M-parameter Llama draft distilled from that target (KL): 1000 steps on corpus text, then
   to 2000 and 3000 steps with 30% target greedy continuations (`DRAFT_STAGES`);
4. a head of every method for that target (`HEAD_RECIPES`: corpus text plus text the target
   wrote itself). Stages 2-4 write a complete zoo to `<work>/stage1`;
5. models/code-target: 150 more unlikelihood steps on 128-token rollouts (`TARGET_UL[1]`);
6. models/code-draft and models/code-target-{eagle,eagle3,medusa,mlp-speculator,mtp}: the
   stage-1 draft and heads fine-tuned for that target (`retarget`, `RETARGET_*`), EAGLE-3 then
   seven times more on more greedy text (`RETARGET_EAGLE3_MORE`);
7. models/code-draft-pard: that draft adapted to parallel drafting (`PARD_STAGES`);
8. models/code-target-dflash: a DFlash drafter for that target (`DFLASH_STAGES`);
9. models/code-target-eagle3-parallel: the EAGLE-3 head made P-EAGLE (`PEAGLE_STAGES`,
   `PEAGLE_MORE`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from specserve.data.zoo import head_dir
from specserve.train.generated import GeneratedData
from specserve.train.heads import train_heads
from specserve.train.lm import ModelShape, train_draft, train_lm
from specserve.train.pard import train_pard
from specserve.train.trainer import TrainConfig
from specserve.train.unlikelihood import UnlikelihoodConfig, train_unlikelihood

TARGET_SHAPE = ModelShape()     # 384 wide, 10 layers, 6 heads / 2 KV heads, untied: 22.0M
DRAFT_SHAPE = ModelShape(hidden_size=192, num_layers=2, num_heads=3, num_kv_heads=1,
                         intermediate_size=512, tie_embeddings=True)          # 2.4M


# Schedule lengths; each stage resumes the previous one (the cosine is recomputed).
TARGET_STAGES = [2600, 5200]      # val bits/byte 1.303 -> 1.115
# Two unlikelihood stages, (config, steps), each fine-tuning the previous model. 8-gram repeats
# (loops), not 4-grams: 4-gram unlikelihood also punished the short repeats code is made of and
# left the distribution flat. The first: 1.115 -> 1.178 bits/byte, greedy distinct 4-grams 0.34
# -> 0.64 on average but 2 of the 8 evaluation completions below 0.5. The second rolls out 128
# tokens, the evaluation's length, where those loops start late.
TARGET_UL: list[tuple[UnlikelihoodConfig, int]] = [
    (UnlikelihoodConfig(ngram=8), 100), (UnlikelihoodConfig(ngram=8, rollout_len=128), 150)]


def target_config(work: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(work_dir=str(work / "code-target"), steps=steps, batch_size=8, seq_len=512,
                       lr=1.5e-3, warmup=100, eval_every=500, ckpt_every=50, **kw)


def unlikelihood_config(work: Path, stage: int, steps: int, **kw) -> TrainConfig:
    name = "code-target-ul" + ("" if stage == 0 else str(stage + 1))
    return TrainConfig(work_dir=str(work / name), steps=steps, batch_size=8, seq_len=512,
                       lr=3e-4, warmup=10, eval_every=steps, ckpt_every=25, **kw)


def draft_config(work: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(work_dir=str(work / "code-draft"), steps=steps, batch_size=8,
                       seq_len=512, lr=2e-3, warmup=50, eval_every=500, ckpt_every=50, **kw)


SAMPLED = GeneratedData(num_generated=128)              # appended once, temperature 0.7
# Greedy continuations, 30% of the training windows: a greedy server verifies these.
GREEDY = GeneratedData(num_generated=1024, generated_temperature=0, generated_share=0.3)

# (schedule length, generated text): each stage resumes the previous one with a longer schedule.
# val bits/byte 1.618 -> 1.539 -> 1.503; on the previous (looping) target the greedy-text stages
# lifted the draft's tau at K=4 on completion prompts from 2.50 to 3.16 and 3.27.
DRAFT_STAGES: list[tuple[int, GeneratedData | None]] = [(1000, None), (2000, GREEDY),
                                                         (3000, GREEDY)]

# methods trained together -> (batch size, extra train_heads arguments, stages). Each stage is
# (schedule length, generated text) and resumes the previous stage's checkpoint with the longer
# schedule (the cosine is recomputed, so the learning rate rises part way back up). The four
# heads that read the target's last hidden state share one target pass per step. eagle3 drafts
# over the 2048 most frequent tokens, which makes its steps cheap enough for longer runs; the
# others compute a full-vocabulary KL per drafted position and get shorter ones. eagle3 is
# unrolled for all K=4 draft steps. The greedy-text stage lifted tau at K=4: eagle3
# 2.31 -> 2.46, eagle 1.71 -> 2.17, mtp 1.95 -> 2.17, medusa 1.37 -> 1.45, mlp_speculator
# 1.46 -> 1.68.
HEAD_RECIPES: dict[tuple[str, ...], tuple[int, dict, list[tuple[int, GeneratedData]]]] = {
    ("eagle3",): (8, {"draft_vocab": 2048}, [(2000, SAMPLED), (2800, GREEDY)]),
    ("medusa", "mlp_speculator", "eagle", "mtp"): (4, {}, [(400, SAMPLED), (1000, GREEDY)]),
}


HEAD_LR = 1e-3                  # the heads' first learning rate; fine-tuning runs at half


def head_config(work: Path, methods: tuple[str, ...], steps: int, **kw) -> TrainConfig:
    batch = HEAD_RECIPES[methods][0]
    return TrainConfig(work_dir=str(work / "heads" / "+".join(methods)), steps=steps,
                       batch_size=batch, seq_len=512, lr=HEAD_LR, warmup=100, eval_every=100_000,
                       ckpt_every=50, **kw)


# Fine-tuning the stage-1 draft and heads for the final target: (steps, generated text), at
# half their first learning rate, starting from their weights. Their work directories are
# `<work>/retarget/...`. On the final target (`bench latency`, completion prompts, K=4) the
# draft's tau went from 2.22 to 2.48 and EAGLE-3's from 2.17 to 2.48.
RETARGET_DRAFT = (800, GREEDY)
RETARGET_HEADS: dict[tuple[str, ...], tuple[int, GeneratedData]] = {
    ("eagle3",): (1000, GREEDY),
    ("medusa", "mlp_speculator", "eagle", "mtp"): (300, GREEDY),
}


class FineTune(NamedTuple):
    """A stage that starts from the model it improves (a fresh schedule, not a resume)."""
    steps: int
    gen: GeneratedData
    refresh_vocab: bool = False     # the draft vocabulary afresh from this stage's text
    lr: float = HEAD_LR / 2
    seed: int = 0                   # another seed draws other training windows
    top1_weight: float = 0.0        # TrainConfig.top1_weight

    def config(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` (the recipe's, for this stage's steps) with this stage's settings and a short
        warmup (the weights are trained already)."""
        return dataclasses.replace(cfg, lr=self.lr, warmup=20, seed=self.seed,
                                   top1_weight=self.top1_weight)


def fine_tunes(stages: list[FineTune], recipe: Callable[..., TrainConfig], work: Path,
               name: str, **kw) -> list[tuple[TrainConfig, FineTune]]:
    """Each fine-tune with its config: `recipe(work dir, steps, **kw)` in
    `<work>/<name>-more<i>`, with the stage's settings."""
    return [(s.config(recipe(work / f"{name}-more{i + 1}", s.steps, **kw)), s)
            for i, s in enumerate(stages)]


# Then EAGLE-3 seven times more, each stage from the previous head, at the same learning rate (the
# last two lower), on more of the target's greedy continuations (every training file's opening,
# then later lines of them): half its windows from 4096 of them, tau at K=4 (`bench latency`)
# 2.48 -> 2.54 on completion prompts, 2.58 -> 2.82 on editing prompts; then 60% from 8192, tau
# 2.54 -> 2.68 and 2.82 -> 2.95; then the same again, tau (bfloat16) 2.68 -> 2.73 and 2.95 ->
# 3.06; then 60% from all 10470 openings (16 per file at most), with the 2048 draft tokens
# chosen again from that text (in a throwaway count the first vocabulary, from corpus text, held
# 95.4% of the target's greedy tokens, the new one 97.7%), tau (bfloat16) 2.73 -> 2.79 and 3.06
# -> 3.19; then 1500 steps on the same text with the training-time test attending as the
# drafting chain does (`unrolled_drafts`; the stages before trained passes 2-4 against the
# previous pass's outputs at every position), tau (float32) 2.79 -> 2.85 and 3.23 -> 3.37, the
# 3rd and 4th drafts gaining most; then 300 and 500 steps at 2e-4 on other windows of it (seeds
# 1 and 2) with a cross-entropy to the target's most likely token added to the KL
# (`top1_weight`), tau 2.85 -> 2.97 and 3.37 -> 3.58.
# In throwaway A/Bs of the first of them (one round of `bench latency`), the same 300 steps without
# the cross-entropy reached 2.90 / 3.49 and with it 2.91 / 3.63; a third stage (500 steps, seed 3)
# added nothing (2.96 / 3.55), nor did 300 steps with top1_weight 3 (2.92 / 3.58).
RETARGET_EAGLE3_MORE: list[FineTune] = [
    FineTune(600, dataclasses.replace(GREEDY, num_generated=4096, generated_share=0.5)),
    FineTune(1800, dataclasses.replace(GREEDY, num_generated=8192, generated_share=0.6)),
    FineTune(1800, dataclasses.replace(GREEDY, num_generated=8192, generated_share=0.6)),
    FineTune(1800, dataclasses.replace(GREEDY, num_generated=10470, generated_share=0.6),
             refresh_vocab=True),
    FineTune(1500, dataclasses.replace(GREEDY, num_generated=10470, generated_share=0.6)),
    *(FineTune(steps, dataclasses.replace(GREEDY, num_generated=10470, generated_share=0.6),
               lr=2e-4, seed=seed, top1_weight=1.0)
      for steps, seed in ((300, 1), (500, 2)))]


def retarget(out: str | Path, work: str | Path, prev: str | Path, **kw) -> bool:
    """Fine-tune the draft and heads of the zoo in `prev` (trained for an earlier version of the
    target) for `<out>/code-target`; writes `<out>/code-draft` and the heads. False when
    stopped on the time limit (run again to resume)."""
    out, work, prev = Path(out) / "code-target", Path(work) / "retarget", Path(prev)
    steps, gen = RETARGET_DRAFT
    cfg = draft_config(work, steps, **kw)
    cfg = dataclasses.replace(cfg, lr=cfg.lr / 2, warmup=20)
    bpb = train_draft(cfg, DRAFT_SHAPE, out, out.parent / "code-draft", gen=gen,
                      init=prev / "code-draft")
    print(f"code-draft (retargeted, {steps} steps): val bits/byte {bpb:.4f}", flush=True)
    if bpb != bpb:
        return False
    for methods, (steps, gen) in RETARGET_HEADS.items():
        cfg = head_config(work, methods, steps, **kw)
        cfg = dataclasses.replace(cfg, lr=cfg.lr / 2, warmup=20)
        extra = HEAD_RECIPES[methods][1]
        results = train_heads({m: Path(head_dir(out, m)) for m in methods}, cfg, out, gen=gen,
                              inits={m: Path(head_dir(prev / "code-target", m))
                                     for m in methods}, **extra)
        if not all(results.values()):
            return False
        _report(results, out, f"retargeted, {steps} steps")
    e3 = Path(head_dir(out, "eagle3"))
    for i, stage in enumerate(RETARGET_EAGLE3_MORE):
        # stage 0 keeps the work directory it had as the only stage
        cfg = stage.config(head_config(work / ("more" if i == 0 else f"more{i + 1}"),
                                       ("eagle3",), stage.steps, **kw))
        results = train_heads({"eagle3": e3}, cfg, out, gen=stage.gen, inits={"eagle3": e3},
                              refresh_vocab=stage.refresh_vocab, **HEAD_RECIPES[("eagle3",)][1])
        if not all(results.values()):
            return False
        _report(results, out, f"more greedy text, {stage.steps} steps")
    return True


# The bundled draft adapted to parallel drafting (PARD): stages of (schedule length, generated
# text) as DRAFT_STAGES, at half the draft's learning rate, from models/code-draft. K = 4 with
# depth weights (gamma 2): with PARD's equal weights over K = 8 copies this 2.4M draft spent
# its capacity on drafts that are never accepted, and drafted its first and second worse.
PARD_STAGES: list[tuple[int, GeneratedData]] = [(600, GREEDY), (1800, GREEDY)]
PARD_K = 4
PARD_DEPTH_GAMMA = 2.0
PARD_LR = 1e-3
# Then twice from that draft, as EAGLE-3's and DFlash's later stages: more greedy continuations
# (60% of the windows, from 8192 openings), other windows (seeds 1, 2), half the learning rate,
# the cross-entropy to the target's top token added. Tau at K=4 (`bench latency`, side by side)
# went 2.02 -> 2.29 on completion prompts and 2.00 -> 2.33 on editing prompts.
PARD_MORE: list[FineTune] = [
    FineTune(3000, dataclasses.replace(GREEDY, num_generated=8192, generated_share=0.6),
             lr=PARD_LR / 2, seed=seed, top1_weight=1.0) for seed in (1, 2)]


def pard_config(work: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(work_dir=str(work / "code-draft-pard"), steps=steps, batch_size=4,
                       seq_len=256, lr=PARD_LR, warmup=20, eval_every=steps, ckpt_every=50,
                       **kw)


def build_pard(out: Path, work: Path, **kw) -> float:
    """`<out>/code-draft-pard` from `<out>/code-draft` for `<out>/code-target`."""
    pard = out / "code-draft-pard"
    stages = [(pard_config(work, steps, **kw), gen, out / "code-draft")
              for steps, gen in PARD_STAGES]
    stages += [(cfg, s.gen, pard)
               for cfg, s in fine_tunes(PARD_MORE, pard_config, work, "pard", **kw)]
    for cfg, gen, init in stages:
        bpb = train_pard(cfg, init, out / "code-target", pard, k=PARD_K, gen=gen,
                         depth_gamma=PARD_DEPTH_GAMMA)
        print(f"code-draft-pard ({cfg.steps} steps): val bits/byte {bpb:.4f}", flush=True)
        if bpb != bpb:
            break
    return bpb


# The DFlash drafter for the final target: DFLASH_LAYERS target-wide layers drafting blocks of
# DFLASH_BLOCK (K up to 7), trained from fresh weights at the heads' learning rate on corpus
# text with target greedy continuations; stages of (schedule length, generated text, blocks per
# window) as HEAD_RECIPES. A block drafter trains on the anchors of a window only (32 of its
# 512 positions), where a head trains on every one: the second stage resumes the first with
# twice the blocks per window and more greedy text.
DFLASH_LAYERS, DFLASH_BLOCK = 3, 8
DFLASH_STAGES: list[tuple[int, GeneratedData, int]] = [
    (3000, GREEDY, 32), (4000, dataclasses.replace(GREEDY, generated_share=0.5), 64)]
# Then twice from the drafter, as EAGLE-3's later stages: more greedy continuations (60% of the
# windows, from 4096 and then 8192 openings), other windows (seeds 1, 2), half the learning
# rate, the cross-entropy to the target's top token added (`top1_weight`), the last stage's
# blocks per window. Tau at K=7 (`bench latency --methods dflash+k=7@DIR,...`, each stage's
# drafter side by side) went 2.27 -> 2.48 -> 2.56 on completion prompts and 2.37 -> 3.00 ->
# 3.10 on editing prompts.
DFLASH_MORE: list[FineTune] = [
    FineTune(2000, dataclasses.replace(GREEDY, num_generated=n, generated_share=0.6),
             seed=seed, top1_weight=1.0) for n, seed in ((4096, 1), (8192, 2))]


def dflash_config(work: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(work_dir=str(work / "code-target-dflash"), steps=steps, batch_size=8,
                       seq_len=512, lr=HEAD_LR, warmup=100, eval_every=100_000, ckpt_every=50,
                       **kw)


def build_dflash(out: Path, work: Path, **kw) -> bool:
    """`<out>/code-target-dflash` for `<out>/code-target`; False when stopped on the time
    limit (run again to resume)."""
    target = out / "code-target"
    d = Path(head_dir(target, "dflash"))
    stages = [(dflash_config(work, steps, **kw), gen, anchors, None)
              for steps, gen, anchors in DFLASH_STAGES]
    stages += [(cfg, s.gen, DFLASH_STAGES[-1][2], d)
               for cfg, s in fine_tunes(DFLASH_MORE, dflash_config, work, "dflash", **kw)]
    for cfg, gen, anchors, init in stages:
        results = train_heads({"dflash": d}, cfg, target, k=DFLASH_BLOCK - 1, gen=gen,
                              inits={"dflash": init} if init else None,
                              head_options={"block_size": DFLASH_BLOCK,
                                            "num_layers": DFLASH_LAYERS, "num_anchors": anchors})
        if not all(results.values()):
            return False
        _report(results, target, f"{cfg.steps} steps")
    return True


# The P-EAGLE head: the bundled EAGLE-3 head fine-tuned to draft PEAGLE_K tokens in one pass
# (K-1 mask copies in training, `eagle3.parallel_drafts`), at half the heads' learning rate on
# windows of 256 tokens (the copies multiply the attention's rows by K). K = 4 with depth
# weights (gamma 2), as PARD: with K = 8 copies weighed alike its drafts past the third were
# never accepted, and its second was accepted less often.
PEAGLE_K = 4
PEAGLE_DEPTH_GAMMA = 2.0
PEAGLE_STAGES: list[tuple[int, GeneratedData]] = [(1200, GREEDY)]
# Then three times from that head, as PARD_MORE: 3000 steps each on greedy continuations from
# 8192 openings (60% of the windows), other windows (seeds 1-3), the cross-entropy to the
# target's top token added. Tau at K=4 (quality.json) went 2.11 -> 2.30 -> 2.48 -> 2.51, the
# second draft accepted 28% -> 37% -> 42% -> 46% of the time. Side by side (`bench latency`,
# completion prompts) tau at K=2 went 1.98 (before) -> 2.17 (after the second) -> 2.19.
PEAGLE_MORE: list[FineTune] = [
    FineTune(3000, dataclasses.replace(GREEDY, num_generated=8192, generated_share=0.6),
             seed=seed, top1_weight=1.0) for seed in (1, 2, 3)]


def peagle_config(work: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(work_dir=str(work / "code-target-eagle3-parallel"), steps=steps,
                       batch_size=4, seq_len=256, lr=HEAD_LR / 2, warmup=20,
                       eval_every=100_000, ckpt_every=50, **kw)


def build_peagle(out: Path, work: Path, **kw) -> bool:
    """`<out>/code-target-eagle3-parallel` from `<out>/code-target-eagle3`; False when stopped
    on the time limit (run again to resume)."""
    target = out / "code-target"
    e3 = Path(head_dir(target, "eagle3"))
    pe = Path(f"{e3}-parallel")
    stages = [(peagle_config(work, steps, **kw), gen, e3) for steps, gen in PEAGLE_STAGES]
    stages += [(cfg, s.gen, pe)
               for cfg, s in fine_tunes(PEAGLE_MORE, peagle_config, work, "peagle", **kw)]
    for cfg, gen, init in stages:
        results = train_heads({"eagle3": pe}, cfg, target, k=PEAGLE_K, gen=gen,
                              inits={"eagle3": init},
                              head_options={"parallel": True,
                                            "depth_gamma": PEAGLE_DEPTH_GAMMA},
                              **HEAD_RECIPES[("eagle3",)][1])
        if not all(results.values()):
            return False
        _report(results, target, f"P-EAGLE, {cfg.steps} steps")
    return True


def _report(results: dict[str, dict], target: Path, stage: str) -> None:
    for m, result in results.items():
        done = f"tau {result['tau']:.2f}" if "tau" in result else result["skipped"]
        print(f"{Path(head_dir(target, m)).name} ({stage}): {done}", flush=True)


def build_zoo(out: str = "models", work: str = "runs", max_minutes: float | None = None,
              device: str = "auto") -> None:
    out_dir, work_dir = Path(out), Path(work)
    stage1 = work_dir / "stage1"          # the zoo for the first unlikelihood stage's target
    kw = {"max_minutes": max_minutes, "device": device}
    pretrained = work_dir / "code-target-pretrained"
    for steps in TARGET_STAGES:
        bpb = train_lm(target_config(work_dir, steps, **kw), TARGET_SHAPE, pretrained,
                       tokenizer_dir=work_dir / "tokenizer")
        print(f"code-target ({steps} steps): val bits/byte {bpb:.4f}", flush=True)
        if bpb != bpb:      # NaN: stopped on the time limit
            return
    ul, steps = TARGET_UL[0]
    bpb = train_unlikelihood(unlikelihood_config(work_dir, 0, steps, **kw), ul, pretrained,
                             stage1 / "code-target")
    print(f"code-target (unlikelihood): val bits/byte {bpb:.4f}", flush=True)
    if bpb != bpb:
        return
    for steps, gen in DRAFT_STAGES:
        bpb = train_draft(draft_config(work_dir, steps, **kw), DRAFT_SHAPE,
                          stage1 / "code-target", stage1 / "code-draft", gen=gen)
        print(f"code-draft ({steps} steps): val bits/byte {bpb:.4f}", flush=True)
        if bpb != bpb:
            return
    for methods, (_, extra, stages) in HEAD_RECIPES.items():
        outs = {m: Path(head_dir(stage1 / "code-target", m)) for m in methods}
        for steps, gen in stages:
            results = train_heads(outs, head_config(work_dir, methods, steps, **kw),
                                  stage1 / "code-target", gen=gen, **extra)
            if not all(results.values()):
                return
            _report(results, stage1 / "code-target", f"{steps} steps")
    ul, steps = TARGET_UL[1]
    bpb = train_unlikelihood(unlikelihood_config(work_dir, 1, steps, **kw), ul,
                             stage1 / "code-target", out_dir / "code-target")
    print(f"code-target (unlikelihood, stage 2): val bits/byte {bpb:.4f}", flush=True)
    if bpb != bpb:
        return
    if not retarget(out_dir, work_dir, stage1, **kw):
        return
    bpb = build_pard(out_dir, work_dir, **kw)
    if bpb != bpb or not build_dflash(out_dir, work_dir, **kw) or not build_peagle(
            out_dir, work_dir, **kw):
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "MANIFEST").write_text(manifest(out_dir))


# The `build_zoo` stages that write each bundled directory (the last one to touch it).
MANIFEST_STAGES = {
    "code-target": "target: pretraining, unlikelihood, unlikelihood stage 2 (TARGET_STAGES, "
                   "TARGET_UL)",
    "code-draft": "draft: DRAFT_STAGES, then retarget (RETARGET_DRAFT)",
    "code-draft-pard": "parallel draft: code-draft adapted by PARD_STAGES, PARD_MORE (train "
                       "pard, K = 4, depth gamma 2)",
    "code-target-dflash": "dflash drafter: DFLASH_STAGES, DFLASH_MORE (3 layers, blocks of 8)",
    "code-target-eagle3-parallel": "P-EAGLE head: code-target-eagle3 by PEAGLE_STAGES, "
                                   "PEAGLE_MORE (K = 4, depth gamma 2)",
    "code-target-eagle3": "eagle3 head: HEAD_RECIPES, retarget, RETARGET_EAGLE3_MORE",
    "code-target-eagle": "eagle head: HEAD_RECIPES, retarget",
    "code-target-medusa": "medusa head: HEAD_RECIPES, retarget",
    "code-target-mlp-speculator": "mlp_speculator head: HEAD_RECIPES, retarget",
    "code-target-mtp": "mtp layer: HEAD_RECIPES, retarget (weight shards link to code-target)",
    "smollm2-135m-instruct-peagle": "P-EAGLE head for SmolLM2-135M-Instruct (it chains as "
                                    "an EAGLE-3 head too: smollm2-135m-instruct-eagle3 is a "
                                    "link): specserve train chat-data, train eagle3 "
                                    "--hidden-states, then train eagle3 --parallel "
                                    "--chain-weight 2 --hidden-states --init "
                                    "(benchmarks/README.md)",
    "smollm2-135m-instruct-mlp_speculator": "mlp_speculator for SmolLM2-135M-Instruct (its "
                                            "state 11 wide, stages tied): specserve train "
                                            "chat-data, then train mlp_speculator "
                                            "--hidden-states --inner-dim 11 "
                                            "(benchmarks/README.md)",
    "smollm2-135m-instruct-mtp": "mtp layer for the frozen SmolLM2-135M-Instruct (its "
                                 "embedding and lm_head shared): specserve train chat-data, "
                                 "then train mtp --hidden-states (benchmarks/README.md)",
    "smollm2-135m-instruct-eagle": "eagle head (EAGLE-1) for SmolLM2-135M-Instruct (its "
                                   "embedding and lm_head shared): specserve train chat-data, "
                                   "then train eagle --hidden-states (benchmarks/README.md)",
    "smollm2-135m-instruct-medusa": "medusa heads for SmolLM2-135M-Instruct (its lm_head "
                                    "shared): specserve train chat-data, then train medusa "
                                    "--hidden-states (benchmarks/README.md)",
    "smollm2-135m-instruct-dflash": "dflash drafter for SmolLM2-135M-Instruct (one layer, "
                                    "blocks of 5; its embedding and lm_head shared): specserve "
                                    "train chat-data, then train dflash --hidden-states "
                                    "(benchmarks/README.md)",
    "smollm2-135m-instruct-pard": "draft model for SmolLM2-135M-Instruct (its vocabulary; 4 "
                                  "layers of width 128; also smollm2-135m-instruct-draft_model, "
                                  "a link): specserve train chat-data, train "
                                  "draft --hidden-states, then train pard --hidden-states "
                                  "(benchmarks/README.md)",
}


def manifest(models: Path) -> str:
    """models/MANIFEST: every bundled file with its sha256, size and the stage that made it
    (the tokenizer files: the BPE step of the target's pretraining)."""
    lines = ["# sha256  bytes  path  stage (specserve zoo build; regenerate with "
             "`specserve zoo manifest`)"]
    for path in sorted(p for p in models.rglob("*") if p.is_file() and p.name != "MANIFEST"):
        rel = path.relative_to(models)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        stage = ("tokenizer: BPE trained with the target" if path.name.startswith(
            ("tokenizer", "special_tokens")) else MANIFEST_STAGES.get(rel.parts[0], "?"))
        lines.append(f"{digest}  {path.stat().st_size}  {rel.as_posix()}  {stage}")
    return "\n".join(lines) + "\n"
