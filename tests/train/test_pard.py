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
