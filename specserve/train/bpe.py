"""Train the byte-level BPE tokenizer of the zoo and write HF tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specserve.data.corpus import read_text

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# ChatML-style; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe(files: list[Path], vocab_size: int = 8192) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS, "bos_token": None, "pad_token": EOS, "unk_token": None,
        "add_bos_token": False, "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True}
                                 for t in SPECIAL_TOKENS},
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")
