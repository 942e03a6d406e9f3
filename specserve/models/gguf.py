"""GGUF files (llama.cpp, Ollama) read with the `gguf` package, llama.cpp's own reader: the
model's shape as a Hugging Face config, its tensors under Hugging Face names in the engine's
dtype, and its tokenizer rebuilt from the metadata with the `tokenizers` library.

Tensors are dequantized one at a time from the memory-mapped file and converted at once, so
loading never holds a second float copy of the model. llama.cpp permutes the rows of Q and K of
`llama` models (its rope pairs neighbouring dimensions; Hugging Face's rotates halves); that is
undone here. Whatever is not understood (an architecture, a tensor type, a tensor name, a
pre-tokenizer) is an error naming it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF architecture -> (Hugging Face architecture, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# Token types of the GGUF vocabulary (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# The text splits of byte-level BPE vocabularies, by `tokenizer.ggml.pre` (llama.cpp's
# llama-vocab.cpp): the regex applied before the byte-level mapping.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# pre-tokenizer -> splits applied in turn ("\p{N}" alone: every digit on its own, as SmolLM's
# tokenizer.json does with its Digits(individual_digits) step)
PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,), "llama-bpe": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


def gguf_path(model: str | Path) -> Path | None:
    """The GGUF file `model` names: the file itself, or the one .gguf file of a directory
    without a config.json; None when `model` is not a GGUF model."""
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        files = sorted(p.glob("*.gguf"))
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ValueError(f"{p} holds {len(files)} GGUF files ({names}); pass the path of "
                             "the one to load")
        if files:
            return files[0]
    return None


def open_gguf(path: str | Path) -> GGUFModel:
    """The GGUFModel of a file, read once per version of the file: gguf's reader takes seconds
    to parse a 50k-token vocabulary, and building an engine asks for the config, the tokenizer
    and the tensors separately."""
    p = Path(path).resolve()
    st = p.stat()
    return _open(p, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFModel:
    return GGUFModel(path)


class GGUFModel:
    """One GGUF file: its metadata as Hugging Face configs, its tensors and its tokenizer."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise ValueError(f"{self.path} could not be read as GGUF ({e})") from e
        self.arch = self._str("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}")

    def meta(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _str(self, key: str) -> str:
        value = self.meta(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
        return value

    def _arch(self, key: str, default=None):
        return self.meta(f"{self.arch}.{key}", default)

    @cached_property
    def hf_config(self) -> dict:
        """The model's config.json as transformers would write it."""
        hf_arch, _ = ARCHITECTURES[self.arch]
        for key in ("block_count", "embedding_length", "feed_forward_length",
                    "attention.head_count"):
            if self._arch(key) is None:
                raise ValueError(f"{self.path}: GGUF metadata {self.arch}.{key} is missing")
        names = {t.name for t in self.reader.tensors}
        heads = self._arch("attention.head_count")
        hidden = self._arch("embedding_length")
        head_dim = self._arch("attention.key_length") or hidden // heads
        vocab = self._arch("vocab_size") or len(self.meta("tokenizer.ggml.tokens", []))
        cfg = {
            "architectures": [hf_arch], "model_type": self.arch,
            "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": self._arch("feed_forward_length"),
            "num_hidden_layers": self._arch("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch("attention.head_count_kv") or heads,
            "head_dim": head_dim,
            "max_position_embeddings": self._arch("context_length", 2048),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "hidden_act": "silu",
        }
        rope_dim = self._arch("rope.dimension_count")
        if rope_dim is not None and rope_dim != head_dim:
            raise ValueError(f"{self.path}: partial rotary ({self.arch}.rope.dimension_count="
                             f"{rope_dim} of head_dim {head_dim}) is not supported")
        scaling = self._arch("rope.scaling.type")
        if scaling in ("linear", "yarn"):
            cfg["rope_scaling"] = {"rope_type": scaling,
                                   "factor": float(self._arch("rope.scaling.factor"))}
            original = self._arch("rope.scaling.original_context_length")
            if original:
                cfg["rope_scaling"]["original_max_position_embeddings"] = original
        elif scaling not in (None, "none"):
            raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported "
                             "(supported: none, linear, yarn)")
        eos = self.meta("tokenizer.ggml.eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = int(eos)
        bos = self.meta("tokenizer.ggml.bos_token_id")
        if bos is not None:
            cfg["bos_token_id"] = int(bos)
        return cfg

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor in `dtype`) for every tensor of the file, one at a time."""
        _, permuted = ARCHITECTURES[self.arch]
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name, self.path)
            try:
                values = dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                version = importlib.metadata.version("gguf")
                raise ValueError(f"{self.path}: tensor {t.name} is of type {t.tensor_type.name}, "
                                 f"which gguf {version} cannot dequantize ({e})") from e
            tensor = torch.from_numpy(np.array(values, dtype=np.float32))     # a writable copy
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                cfg = self.hf_config
                heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
                tensor = unpermute_qk(tensor, heads)
            yield name, tensor.to(dtype)

    def tokenizer(self) -> tuple[HFTokenizer, dict]:
        """The tokenizer and a tokenizer_config.json equivalent (special tokens, add_bos,
        chat_template)."""
        return gguf_tokenizer(self)


def hf_tensor_name(name: str, source: Path | str = "GGUF") -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _BLOCK.match(name)
    if m and m[2] in _LAYER_TENSORS:
        return f"model.layers.{m[1]}.{_LAYER_TENSORS[m[2]]}"
    raise ValueError(f"{source}: GGUF tensor {name!r} is not supported (specserve reads "
                     f"{', '.join(_GLOBAL_TENSORS)} and blk.N.{{{', '.join(_LAYER_TENSORS)}}})")


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permutation of a Q or K weight [heads * d, in]:
    within each head its rows were reordered from (half, d/2) to (d/2, half)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tokenizer(g: GGUFModel) -> tuple[HFTokenizer, dict]:
    kind = g.meta("tokenizer.ggml.model")
    tokens: list[str] = g.meta("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{g.path}: the GGUF has no tokenizer (tokenizer.ggml.tokens); pass "
                         "prompts as token ids (TokensPrompt)")
    types = g.meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(g, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(g, tokens)
    else:
        raise ValueError(f"{g.path}: GGUF tokenizer model {kind!r} is not supported; supported: "
                         "gpt2 (byte-level BPE), llama (SentencePiece BPE)")
    # a control token of a byte-level vocabulary spelled outside its byte alphabet is a
    # llama.cpp mislabel: adding it would grow the vocabulary past the model's
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if kind == "gpt2" else None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types)
                            if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = g.meta(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {"bos_token": token("bos"), "eos_token": token("eos"),
              "unk_token": token("unknown"), "pad_token": token("padding"),
              # llama.cpp adds BOS to SentencePiece vocabularies unless the file says not to
              "add_bos_token": bool(g.meta("tokenizer.ggml.add_bos_token", kind == "llama")),
              "add_eos_token": bool(g.meta("tokenizer.ggml.add_eos_token", False)),
              "chat_template": g.meta("tokenizer.chat_template")}
    return tok, config


def _merges(g: GGUFModel) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in g.meta("tokenizer.ggml.merges") or []]


def _byte_level_bpe(g: GGUFModel, tokens: list[str]) -> HFTokenizer:
    pre = g.meta("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{g.path}: GGUF pre-tokenizer {pre!r} is not supported; supported: "
                         f"{', '.join(PRE_TOKENIZERS)}")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab, _merges(g), fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(g: GGUFModel, tokens: list[str]) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (Llama 2, Mistral): merges from the file, or recovered
    from the scores (a pair merges into a token ranked by that token's score)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(g)
    if not merges:
        scores = g.meta("tokenizer.ggml.scores") or [0.0] * len(tokens)
        ranked = []
        for t, i in vocab.items():
            for cut in range(1, len(t)):
                left, right = t[:cut], t[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-scores[i], vocab[left], vocab[right], left, right))
        merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = g.meta("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token=tokens[unk] if unk is not None else None,
                                 byte_fallback=True, fuse_unk=True))
    prefix = g.meta("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok

