"""Tokenizer from a HF model directory (tokenizer.json + tokenizer_config.json), chat template,
and an incremental detokenizer that never emits half of a multi-byte character."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        """The tokenizer of a Hugging Face model directory."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; a model directory needs tokenizer.json "
                                    "(pass prompts as TokensPrompt to run without one)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path} could not be parsed: {e}") from e
        cfg_path = d / "tokenizer_config.json"
        config: dict = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        # transformers 5 writes the template to its own file; 4.x into tokenizer_config.json
        template_path = d / "chat_template.jinja"
        if template_path.is_file():
            config["chat_template"] = template_path.read_text()
        self._setup(tok, config)

    @classmethod
    def from_parts(cls, tok: HFTokenizer, config: dict) -> Tokenizer:
        """A tokenizer built elsewhere (from a GGUF's metadata) with its tokenizer_config."""
        self = cls.__new__(cls)
        self._setup(tok, config)
        return self

    def _setup(self, tok: HFTokenizer, config: dict) -> None:
        self._tok = tok
        self.config = config
        template = config.get("chat_template")
        if isinstance(template, list):      # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template
        self.eos_token: str | None = _token_str(self.config.get("eos_token"))
        self.bos_token: str | None = _token_str(self.config.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer.json text (what a grammar engine reads the vocabulary from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if self.add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (neither chat_template.jinja nor "
                             "tokenizer_config.json's chat_template, nor GGUF metadata "
                             "tokenizer.chat_template); use completions, or add one")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_str(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise(message: str):
    raise ValueError(message)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window [prefix_offset, len) and compares it with the window's text so far;
    text ending in U+FFFD is held back until the next tokens complete the character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])    # a little context for correct spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        dec = self.tokenizer.decode
        prefix_text = dec(self.ids[self.prefix_offset:self.read_offset])
        full = dec(self.ids[self.prefix_offset:])
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT_CHAR):
            delta = full[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), for a finished request."""
        dec = self.tokenizer.decode
        rest = dec(self.ids[self.prefix_offset:])[len(dec(self.ids[self.prefix_offset:self.read_offset])):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += rest
        return rest
