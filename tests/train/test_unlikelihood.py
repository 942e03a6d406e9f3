"""Unlikelihood fine-tuning against greedy repeats."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.data.corpus import read_text
from specserve.train.trainer import TrainConfig


def test_repeat_mask_marks_every_token_of_a_repeated_ngram():
    from specserve.train.unlikelihood import repeat_mask
    rows = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    assert repeat_mask(rows, 4).tolist() == [
        [False] * 4 + [True] * 4 + [False], [False] * 9]
    assert repeat_mask(torch.tensor([[7, 7, 7, 7, 7]]), 2).tolist() == [[False] + [True] * 4]


def test_greedy_rollouts_match_the_engine(tiny_lm):
    from specserve.models.loader import load_model
    from specserve.train.unlikelihood import greedy_rollouts
    out, _, _ = tiny_lm
    model = load_model(out, torch.float32, torch.device("cpu"))
    prefixes = torch.tensor([[5, 17, 30, 2, 99, 41], [8, 8, 120, 3, 7, 64]])
    got = greedy_rollouts(model, prefixes, 10)
    llm = LLM(str(out), device="cpu")
    ref = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prefixes.tolist()],
                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)
    assert got.tolist() == [o.outputs[0].token_ids for o in ref]


def test_unlikelihood_fine_tuning_reduces_greedy_repeats(tiny_lm, small_corpus, tmp_path):
    """The tiny model loops under greedy decoding; unlikelihood steps make it loop less on
    openings it was not trained on, and the output is a loadable HF directory."""
    from specserve.models.loader import load_model
    from specserve.train.unlikelihood import (
        UnlikelihoodConfig,
        greedy_rollouts,
        repeat_mask,
        train_unlikelihood,
    )
    out, _, _ = tiny_lm
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = read_text(small_corpus.val_files[0])
    ids = tok.encode(text).ids
    prefixes = torch.tensor([ids[i:i + 16] for i in range(0, 8 * 40, 40)])   # [8, 16]

    def repeats(model_dir: Path) -> float:
        model = load_model(model_dir, torch.float32, torch.device("cpu"))
        return repeat_mask(greedy_rollouts(model, prefixes, 48), 4).float().mean().item()

    before = repeats(out)
    assert before > 0.3, "the tiny model should loop before fine-tuning"
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=60, batch_size=4, seq_len=64,
                      lr=2e-3, warmup=2, eval_every=30, bf16=False, device="cpu")
    # the tiny model is nearly uniform: its repeats have small p, hence a large weight
    ul = UnlikelihoodConfig(ul_weight=20.0, prefix_len=16, rollout_len=48, ngram=4)
    bpb = train_unlikelihood(cfg, ul, out, tmp_path / "ul", corpus=small_corpus)
    assert 0 < bpb < 10
    after = repeats(tmp_path / "ul")
    assert after < before * 0.6, (before, after)
    LLM(str(tmp_path / "ul"), device="cpu").generate("def f(x):", SamplingParams(max_tokens=4),
                                                     use_tqdm=False)
