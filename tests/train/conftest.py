"""Shared by the training tests: a few corpus files and a tiny LM trained on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve.data.corpus import Corpus
from specserve.train.lm import ModelShape, train_lm
from specserve.train.trainer import TrainConfig
from tests.conftest import DEVICE

REPO = Path(__file__).resolve().parents[2]
TINY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_position_embeddings=128)


@pytest.fixture(scope="module")
def small_corpus() -> Corpus:
    c = Corpus.stdlib()
    return Corpus(c.train_files[:12], c.val_files[:2])


@pytest.fixture(scope="module")
def tiny_lm(small_corpus, tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    out = tmp_path_factory.mktemp("lm")
    cfg = TrainConfig(work_dir=str(work), steps=40, batch_size=4, seq_len=64, lr=3e-3, warmup=5,
                      eval_every=40, bf16=False, device=DEVICE)
    bpb = train_lm(cfg, TINY, out, vocab_size=400, corpus=small_corpus)
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    return out, bpb, log


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0)
