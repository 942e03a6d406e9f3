"""Language-model and draft training: loss, HF output, resume, stages, init."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.train.generated import GeneratedData
from specserve.train.lm import ModelShape, train_draft, train_lm
from specserve.train.trainer import TrainConfig
from tests.conftest import DEVICE
from tests.train.conftest import TINY, _assert_same_weights


def test_training_lowers_loss_and_writes_hf_dir(tiny_lm):
    out, bpb, log = tiny_lm
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < first - 0.5
    assert 0 < bpb < 10
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "loss.png"):
        assert (out / f).is_file(), f
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_trained_model_loads_in_transformers_with_equal_greedy(tiny_lm):
    from transformers import AutoModelForCausalLM
    out, _, _ = tiny_lm
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    llm = LLM(str(out), device=DEVICE)
    prompt = llm.get_tokenizer().encode("import os\ndef ")
    got = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False)[0, len(prompt):].tolist()
    assert got == ref


def test_resume_continues_from_checkpoint(small_corpus, tiny_lm, tmp_path):
    out, _, _ = tiny_lm
    cfg = TrainConfig(work_dir=str(tmp_path), steps=6, batch_size=2, seq_len=32, warmup=2,
                      ckpt_every=3, eval_every=6, bf16=False, device=DEVICE, max_minutes=0.0)
    train_lm(cfg, TINY, tmp_path / "out", tokenizer_dir=out, corpus=small_corpus)
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 1  # stopped at once
    cfg.max_minutes = None
    bpb = train_lm(cfg, TINY, tmp_path / "out", tokenizer_dir=out, corpus=small_corpus)
    steps = [json.loads(x)["step"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6] and bpb == bpb


def test_staged_build_reruns_past_finished_stages(small_corpus, tiny_lm, tmp_path):
    """A staged build (schedules of 4 then 8 steps) rerun from the start after the second stage
    has begun: the first stage is already behind the checkpoint and is skipped (it used to fail
    looking for its validation result), the second resumes."""
    target, _, _ = tiny_lm
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, tie_embeddings=True, max_position_embeddings=128)

    def stage(steps: int, max_minutes: float | None = None) -> float:
        cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=steps, batch_size=2, seq_len=32,
                          warmup=1, eval_every=4, ckpt_every=1, bf16=False, device=DEVICE,
                          max_minutes=max_minutes)
        return train_draft(cfg, shape, target, tmp_path / "draft", corpus=small_corpus)

    first = stage(4)
    for _ in range(2):
        assert math.isnan(stage(8, max_minutes=0.0))     # stopped after one step: resume later
    assert json.loads((tmp_path / "w" / "checkpoint.json").read_text())["step"] == 6
    assert stage(4) == first                        # behind the checkpoint: skipped
    assert stage(8) == stage(8) and (tmp_path / "draft" / "config.json").is_file()
    assert stage(4) == first                        # its own result, not the later stage's


def test_draft_distillation_lowers_kl(small_corpus, tiny_lm, tmp_path):
    target, _, _ = tiny_lm
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, tie_embeddings=True, max_position_embeddings=128)
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=30, batch_size=4, seq_len=64, lr=3e-3,
                      warmup=3, eval_every=30, bf16=False, device=DEVICE)
    gen = GeneratedData(num_generated=3, generated_len=12, generated_temperature=0,
                        generated_share=0.2)
    train_draft(cfg, shape, target, tmp_path / "draft", corpus=small_corpus, gen=gen)
    greedy = np.load(tmp_path / "w" / "generated-3x12-t0.npy")
    assert len(greedy) > 3 * 12
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["kl"] < log[0]["kl"] * 0.7
    llm = LLM(str(target), device=DEVICE, speculative_config={
        "model": str(tmp_path / "draft"), "num_speculative_tokens": 2})
    llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.get_stats()["spec_decode_num_drafts"] > 0


def test_draft_training_starts_from_init(small_corpus, tiny_lm, tmp_path):
    target, _, _ = tiny_lm
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, tie_embeddings=True, max_position_embeddings=128)

    def run(work: str, out: str, lr: float, **kw) -> None:
        cfg = TrainConfig(work_dir=str(tmp_path / work), steps=4, batch_size=2, seq_len=32,
                          lr=lr, warmup=1, bf16=False, device=DEVICE)
        train_draft(cfg, shape, target, tmp_path / out, corpus=small_corpus, **kw)

    run("w1", "first", 3e-3)
    run("w2", "again", 0.0, init=tmp_path / "first")
    _assert_same_weights(tmp_path / "first", tmp_path / "again")


@pytest.mark.parametrize(("bf16", "flags", "autocast"), [
    (None, {"avx2", "fma"}, False),             # an AVX2 CPU only converts: no autocast
    (None, {"avx512f", "avx512_bf16"}, True),
    (None, {"avx512f", "amx_bf16"}, True),
    (True, {"avx2"}, True),                     # an explicit setting wins
    (False, {"amx_bf16"}, False)])
def test_bf16_autocast_defaults_to_cpus_that_multiply_bfloat16(bf16, flags, autocast,
                                                              monkeypatch, tmp_path):
    """Left unset, training autocasts to bfloat16 only where the CPU has bfloat16 products;
    the loss runs under what was chosen and train_config.json records it."""
    from specserve.train import trainer
    monkeypatch.setattr(trainer, "cpu_flags", lambda: flags)
    seen = []
    w = torch.nn.Linear(4, 1)

    def loss_fn(batch):
        seen.append(torch.is_autocast_enabled("cpu"))
        return w(batch[:, :4].float()).pow(2).mean(), {"loss": 0.0}

    cfg = TrainConfig(work_dir=str(tmp_path), steps=1, batch_size=2, seq_len=8, warmup=1,
                      bf16=bf16, device="cpu")
    trainer.train(w, np.arange(64), cfg, torch.device("cpu"), loss_fn)
    assert seen == [autocast]
    assert json.loads((tmp_path / "train_config.json").read_text())["bf16"] is autocast
