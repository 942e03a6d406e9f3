"""`specserve train pard`: a draft adapted to parallel drafting, written with its mask token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specserve import LLM, SamplingParams
from specserve.methods.parallel import unused_token
from specserve.train.pard import train_pard
from specserve.train.trainer import TrainConfig
from tests.conftest import DEVICE


def test_pard_training_writes_a_parallel_draft_with_its_tau(small_corpus, tiny_lm, tmp_path):
    target, _, _ = tiny_lm
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=3, batch_size=2, seq_len=32, lr=1e-3,
                      warmup=1, eval_every=3, bf16=False, device=DEVICE)
    bpb = train_pard(cfg, target, target, tmp_path / "pard", k=4, corpus=small_corpus)
    assert 0 < bpb < 20
    config = json.loads((tmp_path / "pard" / "config.json").read_text())
    assert config["pard_token"] >= 3 and config["pard_k"] == 4
    quality = json.loads((tmp_path / "pard" / "quality.json").read_text())
    assert set(quality["tau"]) == {"2", "4"} and quality["tau"]["4"]["tau"] >= 1
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert {"ce_copy0", "ce_last", "kl"} <= set(log[-1])
    llm = LLM(str(target), device=DEVICE, speculative_config={
        "model": str(tmp_path / "pard"), "num_speculative_tokens": 4, "parallel_drafting": True})
    llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.get_stats()["spec_decode_num_drafts"] > 0


def test_the_mask_token_is_an_id_the_text_never_holds():
    assert unused_token(np.array([0, 1, 2, 3, 4, 6, 6]), 10) == 5
    with pytest.raises(ValueError, match="no id is free"):
        unused_token(np.arange(10), 10)


def test_depth_weights_count_each_copy_as_asked(tiny_lm):
    """pard_loss weighs copy c's rows by exp(-c / depth_gamma): with a tiny gamma only the real
    rows count, and the loss is the draft's plain distillation loss as an LM; without gamma
    every row counts alike; with gamma 2 the copies' means mix in that proportion."""
    import math

    import torch

    from specserve.models.loader import load_model
    from specserve.train.pard import pard_loss
    from specserve.train.trainer import lm_loss
    target, _, _ = tiny_lm
    draft = load_model(target, torch.float32, torch.device("cpu"))
    teacher = load_model(target, torch.float32, torch.device("cpu"))
    with torch.no_grad():                         # a draft that differs from its teacher
        draft.lm_head.weight.mul_(1.5)
    xy = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = lm_loss(draft, teacher, kd_alpha=0.5)(xy)
        first, _ = pard_loss(draft, teacher, 2, 399, 0.5, depth_gamma=1e-6)(xy)
        even, _ = pard_loss(draft, teacher, 2, 399, 0.5)(xy)
        decayed, _ = pard_loss(draft, teacher, 2, 399, 0.5, depth_gamma=2.0)(xy)
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
    n0, n1 = 16, 15                               # real rows; the mask copy skips its first
    second = ((n0 + n1) * even - n0 * first) / n1                 # the mask copy's mean
    w1 = math.exp(-1 / 2.0)
    torch.testing.assert_close(decayed, (n0 * first + n1 * w1 * second) / (n0 + n1 * w1))
    assert abs(float(second - first)) > 1e-3      # the copies differ: the weights matter


def test_top1_weight_adds_the_cross_entropy_to_the_targets_top_token(tiny_lm):
    """On the real rows alone (a tiny depth gamma) pard_loss with top1_weight is the heads'
    distillation loss: KL to the target plus the cross-entropy to its most likely token."""
    import torch

    from specserve.models.loader import load_model
    from specserve.train.heads import _distill
    from specserve.train.pard import pard_loss
    from specserve.train.trainer import _positions
    target, _, _ = tiny_lm
    draft = load_model(target, torch.float32, torch.device("cpu"))
    teacher = load_model(target, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        draft.lm_head.weight.mul_(1.5)
    xy = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    x = xy[:, :-1]
    with torch.no_grad():
        got, _ = pard_loss(draft, teacher, 2, 399, 1.0, depth_gamma=1e-6, top1_weight=0.7)(xy)
        plain, _ = pard_loss(draft, teacher, 2, 399, 1.0, depth_gamma=1e-6)(xy)
        logits = draft.compute_logits(draft(x, _positions(x)))
        t_logp = torch.log_softmax(teacher.compute_logits(teacher(x, _positions(x))), -1)
        want = _distill(logits, t_logp, top1_weight=0.7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got - plain) > 1e-3
