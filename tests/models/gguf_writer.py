"""Write a transformers model as llama.cpp's converter does (tensor names, Q/K rows permuted
for `llama`, weights quantized with gguf's own quantizer), for tests of the GGUF reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from specserve.models.gguf import _GLOBAL_TENSORS, _LAYER_TENSORS

_TO_GGUF = {v: k for k, v in _GLOBAL_TENSORS.items()}
_LAYER_TO_GGUF = {v: k for k, v in _LAYER_TENSORS.items()}
# gguf's Python package dequantizes these but cannot quantize them: tests write random blocks
RAW_ONLY = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permutation of a Hugging Face Q or K weight (what gguf.unpermute_qk
    undoes): within each head its rows go from (half, d/2) to (d/2, half)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, i, rest = hf_name.split(".", 3)               # model.layers.<i>.<rest>
    return f"blk.{i}.{_LAYER_TO_GGUF[rest]}"


def random_blocks(shape: tuple[int, int], qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random bytes of a quantized tensor, with each block's float16 scales set small and finite
    (they lie at the end of Q2_K's blocks, the start of the others')."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes() * 2, dtype=np.uint8)
    if qtype.name == "Q2_K":
        raw[..., -4:] = scale
    elif qtype.name == "Q6_K":
        raw[..., -2:] = scale[:2]
    else:
        raw[..., :4] = scale
    return raw.reshape(shape[0], -1)


def write_gguf(model: torch.nn.Module, path: Path, arch: str, qtype: str = "F32",
               tokens: list[str] | None = None, seed: int = 0) -> Path:
    cfg = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens or [f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_merges([])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_eos_token_id(cfg.vocab_size - 1)
    q = GGMLQuantizationType[qtype]
    for i, (name, t) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.detach().float()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = permute_qk(t, heads)
        data = t.numpy()
        if t.dim() == 2 and qtype != "F32":
            data = (random_blocks(tuple(t.shape), q, seed + i) if qtype in RAW_ONLY
                    else quantize(data, q))
            w.add_tensor(gguf_name(name), data, raw_dtype=q)
        else:
            w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_sentencepiece_gguf(path: Path) -> Path:
    """A tokenizer-only GGUF with a SentencePiece BPE vocabulary as llama.cpp stores Llama 2's:
    tokens, scores (no merges), byte tokens <0xNN>, control <s> </s>, unknown <unk>."""
    w = GGUFWriter(str(path), "llama")
    pieces = ["▁", "t", "h", "e", "a", "c", "s", "o", "n", "▁t", "he", "▁the", "at", "▁c",
              "▁cat", "▁s", "on", "▁on", "▁a", "er", "▁h", "▁he", "ll", "o▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
