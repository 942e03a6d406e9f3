"""Prompt types accepted by `LLM.generate`."""

from __future__ import annotations

from typing import TypedDict


class TokensPrompt(TypedDict):
    """A prompt given as token ids (no tokenizer needed)."""

    prompt_token_ids: list[int]


PromptType = str | TokensPrompt
