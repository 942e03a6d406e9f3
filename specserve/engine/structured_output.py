"""Structured output with speculation: a request's grammar (llguidance) masks every row the
target samples from, so that the output is exactly what the masked target gives without drafts.

- Drafts: a chain is cut at its first token the grammar rejects before verification (a draft the
  masked target cannot emit would only be rejected there). Tree nodes stay: the verifier rejects
  an impossible node with its subtree.
- Verify rows: row 0 (the token after the last verified one) is masked by the grammar's current
  state, the row after draft node i by the state after the path to node i; the grammar is rolled
  back after each path, so it never holds a draft.
- Accepted tokens: consumed once the verifier has chosen them; a rejected draft never touched it.

llguidance was chosen over xgrammar by measurement (`benchmarks/grammar_engines.py`, SmolLM2's
49,152-token vocabulary): about the same mask cost per token (tens of microseconds, against a
decode step of tens of milliseconds), a JSON schema compiled in about a millisecond instead of
hundreds, and rollback and draft validation built in.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.torch as llt
import torch
from llguidance.gbnf_to_lark import any_to_lark

from specserve.sampling_params import StructuredOutputsParams
from specserve.token_tree import draft_paths
from specserve.tokenizer import Tokenizer

# JSON as models write it ({"a": 1, "b": [2, 3]}), without the freedom to pad it with
# whitespace: a small model left that freedom can spend its whole budget on it
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(so: StructuredOutputsParams) -> str:
    """llguidance's grammar for the request's constraint (ValueError naming what is wrong)."""
    M = llguidance.LLMatcher
    what = "grammar"
    try:
        if so.json is not None or so.json_object:
            what = "json (not a JSON schema object)"
            return M.grammar_from_json_schema({"type": "object"} if so.json_object else so.json,
                                              overrides=JSON_STYLE)
        if so.regex is not None:
            what = "regex"
            return M.grammar_from_regex(so.regex)
        if so.choice is not None:
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
        return M.grammar_from_lark(any_to_lark(so.grammar))       # Lark, or GBNF converted
    except Exception as e:  # noqa: BLE001 - llguidance raises bare Exceptions for bad input
        raise ValueError(f"structured_outputs {what}: {e}") from None


class Grammars:
    """The engine's grammar compiler: one llguidance tokenizer over the target's vocabulary
    (built on first use: about a second for 49k tokens), a matcher per request."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_id: int | None) -> None:
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self._ll: llguidance.LLTokenizer | None = None

    def matcher(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the output (ValueError naming what is wrong)."""
        if self.tokenizer is None or self.eos_id is None:
            raise ValueError("structured_outputs needs the model's tokenizer and an EOS token "
                             "(tokenizer.json with an eos_token)")
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                              eos_token=self.eos_id)
        m = llguidance.LLMatcher(self._ll, grammar_text(so), log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs: the grammar is not valid: {m.get_error()}")
        return m

    @staticmethod
    def valid_drafts(m: llguidance.LLMatcher, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows from its state."""
        return m.validate_tokens(drafts) if drafts else 0

    def mask_rows(self, m: llguidance.LLMatcher, logits: torch.Tensor, drafts: list[int],
                  parents: list[int] | None) -> None:
        """Mask a request's verify rows in place: logits [1 + len(drafts), V], row 0 after the
        verified tokens, row i + 1 after the path to draft node i (a chain's path: its first
        i + 1 drafts)."""
        masks = llt.allocate_token_bitmask(len(logits), self.vocab_size)  # [rows, words] int32
        llt.fill_next_token_bitmask(m, masks, 0)
        for i, path in enumerate(draft_paths(drafts, parents)[1:]):
            n = m.try_consume_tokens(path)
            if n == len(path):                  # else unreachable: an earlier draft is rejected
                llt.fill_next_token_bitmask(m, masks, i + 1)
            m.rollback(n)
        llt.apply_token_bitmask_inplace(logits, masks.to(logits.device))
