"""`specserve train lm` and `specserve train draft`: build a Llama-format model on the corpus.

Work files (checkpoint, token cache, log) live in a work directory; the final HF model
directory (config.json, bf16 safetensors, tokenizer files, generation_config.json) is written to
`--out` when training finishes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

from specserve.config import resolve_device
from specserve.data.corpus import Corpus, encode_files
from specserve.models.cpu_backend import use_decode_linears
from specserve.models.llama import LlamaArgs, LlamaForCausalLM
from specserve.models.loader import load_model, save_model
from specserve.train.bpe import EOS, save_tokenizer, train_bpe
from specserve.train.generated import GeneratedData, with_generated
from specserve.train.trainer import (
    LossFn,
    TrainConfig,
    bf16_autocast,
    evaluate_bpb,
    lm_loss,
    train,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class ModelShape:
    hidden_size: int = field(default=384, metadata={"help": "model width"})
    num_layers: int = field(default=10, metadata={"help": "decoder layers"})
    num_heads: int = field(default=6, metadata={"help": "attention heads"})
    num_kv_heads: int = field(default=2, metadata={"help": "key/value heads (GQA)"})
    intermediate_size: int = field(default=1024, metadata={"help": "MLP width"})
    tie_embeddings: bool = field(default=False, metadata={"help": "share embedding and lm_head"})
    max_position_embeddings: int = field(default=1024, metadata={"help": "context length"})

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")

    def args(self, vocab_size: int) -> LlamaArgs:
        return LlamaArgs(
            architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=1e-5,
            rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=self.tie_embeddings,
            attention_bias=False, qk_norm=False, sliding_window=None)


def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    """GPT-2 style init: N(0, 0.02), residual projections scaled by depth."""
    g = torch.Generator().manual_seed(seed)
    std = 0.02
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        s = std / (2 * model.args.num_hidden_layers) ** 0.5 if name.endswith(
            ("o_proj.weight", "down_proj.weight")) else std
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * s)


def prepare_data(tok_dir: Path, work: Path, corpus: Corpus, vocab_size: int
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """Train (or reuse) the tokenizer in `tok_dir` and cache the encoded corpus in `work`."""
    if not (tok_dir / "tokenizer.json").is_file():
        save_tokenizer(train_bpe(corpus.train_files, vocab_size), tok_dir)
    tok = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    cache = work / "tokens.npz"
    if cache.is_file():
        z = np.load(cache)
        return z["train"], z["val"], int(z["val_bytes"])
    train_ids, _ = encode_files(tok, corpus.train_files, eos)
    val_ids, val_bytes = encode_files(tok, corpus.val_files, eos)
    work.mkdir(parents=True, exist_ok=True)
    np.savez(cache, train=train_ids, val=val_ids, val_bytes=val_bytes)
    return train_ids, val_ids, val_bytes


def export(model: LlamaForCausalLM, work: Path, tok_dir: Path, out: Path, eos_id: int,
           val_bpb: float) -> None:
    save_model(model, out, dtype=torch.bfloat16)
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file() and tok_dir != out:
            shutil.copy(tok_dir / f, out / f)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_id, "bos_token_id": None, "do_sample": False}, indent=2) + "\n")
    for f in ("loss.png", "train_log.jsonl"):
        if (work / f).is_file():
            shutil.copy(work / f, out / f)
    (out / "quality.json").write_text(json.dumps(
        {"val_bits_per_byte": val_bpb, "parameters": model.num_parameters()}, indent=2) + "\n")


def train_and_export(model, train_ids: np.ndarray, val: tuple[np.ndarray, int], cfg: TrainConfig,
                     device: torch.device, loss_fn: LossFn, tok_dir: Path, out: Path) -> float:
    """Train, validate in bits per byte, and export the HF directory to `out` once the schedule
    is done; returns the validation bits per byte (NaN when stopped on the time limit)."""
    val_ids, val_bytes = val
    bf16 = bf16_autocast(cfg, device)
    log = train(model, train_ids, cfg, device, loss_fn, lambda: {
        "val_bpb": evaluate_bpb(model, val_ids, val_bytes, cfg.seq_len, device, bf16)})
    if not log or log[-1]["step"] < cfg.steps:
        return float("nan")           # resume to finish
    if log[-1]["step"] > cfg.steps:   # a later stage of a staged build already resumed past this one
        return next(e["val_bpb"] for e in reversed(log)
                    if "val_bpb" in e and e["step"] <= cfg.steps)
    bpb = log[-1]["val_bpb"]
    eos = HFTokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id(EOS)
    export(model, Path(cfg.work_dir), tok_dir, out, eos, bpb)
    return bpb


def _setup(cfg: TrainConfig) -> torch.device:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    return resolve_device(cfg.device)


def train_lm(cfg: TrainConfig, shape: ModelShape, out: Path, vocab_size: int = 8192,
             tokenizer_dir: Path | None = None, corpus: Corpus | None = None) -> float:
    """Pretrain a model; returns its validation bits per byte."""
    device = _setup(cfg)
    work = Path(cfg.work_dir)
    tok_dir = tokenizer_dir or work / "tokenizer"
    train_ids, val_ids, val_bytes = prepare_data(tok_dir, work, corpus or Corpus.stdlib(),
                                                 vocab_size)
    vocab = HFTokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    model = LlamaForCausalLM(shape.args(vocab))
    init_weights(model, cfg.seed)
    print(f"model: {model.num_parameters() / 1e6:.2f}M parameters; train tokens "
          f"{len(train_ids) / 1e6:.2f}M, val tokens {len(val_ids) / 1e6:.3f}M", flush=True)
    return train_and_export(model, train_ids, (val_ids, val_bytes), cfg, device, lm_loss(model),
                            tok_dir, out)


def train_draft(cfg: TrainConfig, shape: ModelShape, target_dir: Path, out: Path,
                corpus: Corpus | None = None, gen: GeneratedData | None = None,
                init: Path | None = None) -> float:
    """Distil a small draft from `target_dir`: KL to the target on corpus text, plus text the
    target generates when `gen` asks for it (none by default). With `init`, start from that
    trained draft (its own shape; one distilled from an earlier version of the target, say)
    instead of fresh weights of `shape`."""
    device = _setup(cfg)
    work = Path(cfg.work_dir)
    teacher = load_model(target_dir, torch.float32, device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    corpus = corpus or Corpus.stdlib()
    train_ids, val_ids, val_bytes = prepare_data(target_dir, work, corpus, 0)
    if gen is not None:
        train_ids = with_generated(train_ids, gen, target_dir, corpus, work, cfg.seed)
    if init is None:
        model = LlamaForCausalLM(shape.args(teacher.args.vocab_size))
        init_weights(model, cfg.seed)
    else:
        model = load_model(init, torch.float32, device)
        if model.args.vocab_size != teacher.args.vocab_size:
            raise ValueError(f"--init {init}: the draft's vocabulary ({model.args.vocab_size}) is "
                             f"not the target's ({teacher.args.vocab_size})")
    print(f"draft: {model.num_parameters() / 1e6:.2f}M parameters; target "
          f"{teacher.num_parameters() / 1e6:.2f}M", flush=True)
    return train_and_export(model, train_ids, (val_ids, val_bytes), cfg, device,
                            lm_loss(model, teacher, cfg.kd_alpha), target_dir, out)


def measure_bpb(model_dir: Path, device: str = "cpu", corpus: Corpus | None = None,
                quantization: str | None = None) -> float:
    """Validation bits per byte of a saved model on the held-out corpus files (`quantization`:
    with its weights quantized as the engine would, through the CPU kernel)."""
    dev = resolve_device(device)
    model = load_model(model_dir, torch.float32, dev)
    if quantization is not None:
        model = use_decode_linears(model, quantization=quantization)
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    val_ids, val_bytes = encode_files(tok, (corpus or Corpus.stdlib()).val_files,
                                      tok.token_to_id(EOS))
    return evaluate_bpb(model, val_ids, val_bytes, 512, dev, bf16=False)
