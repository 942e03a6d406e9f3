"""Benchmark prompt sets built from the held-out corpus files (never trained on).

- completion: the opening lines of a function or class; the model continues it freely.
- editing: a code block followed by the start of the same block again, as in "rewrite this code"
  tasks whose answer repeats much of the prompt (where prompt lookup shines).
- chat: the held-out chat prompts (`chat_prompts`), each a user message that the benchmark
  renders with the target's chat template (CHAT_SETS).
"""

from __future__ import annotations

import re

from specserve.data.chat_prompts import chat_prompts
from specserve.data.corpus import Corpus, read_text

_DEF = re.compile(r"^(    )?(def|class) \w+", re.M)


def _blocks(num: int, min_lines: int, max_lines: int) -> list[str]:
    out = []
    for path in Corpus.stdlib().val_files:
        text = read_text(path)
        for m in _DEF.finditer(text):
            lines = text[m.start():].split("\n")[:max_lines]
            if len(lines) >= min_lines and all(len(x) < 120 for x in lines):
                out.append("\n".join(lines))
            if len(out) >= num * 4:
                break
    # Spread the picks over files and positions, deterministically.
    step = max(1, len(out) // num)
    return out[::step][:num]


def completion_prompts(num: int = 8) -> list[str]:
    return [block.rsplit("\n", 8)[0] + "\n" for block in _blocks(num, 12, 14)]


def editing_prompts(num: int = 8) -> list[str]:
    out = []
    for block in _blocks(num, 16, 24):
        first = block.split("\n", 2)
        out.append(f"# Original version:\n{block}\n\n# Same code, reformatted:\n"
                   f"{first[0]}\n{first[1]}\n")
    return out


def heldout_chat_prompts(num: int = 8) -> list[str]:
    return chat_prompts("heldout")[:num]


PROMPT_SETS = {"completion": completion_prompts, "editing": editing_prompts,
               "chat": heldout_chat_prompts}
CHAT_SETS = frozenset({"chat"})         # user messages: rendered with the chat template
