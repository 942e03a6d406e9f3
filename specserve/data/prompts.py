"""Benchmark prompt sets built from the held-out corpus files (never trained on).

- completion: the opening lines of a function or class; the model continues it freely.
- editing: a code block followed by the start of the same block again, as in "rewrite this code"
  tasks whose answer repeats much of the prompt (where prompt lookup shines).
- chat: the held-out chat prompts (`chat_prompts`), each a user message that the benchmark
  renders with the target's chat template (CHAT_SETS).
- chat-more: the held-out prompts of the second pool (`chat_prompts(..., pool="more")`: new
  topics and new kinds of request), chat messages too.
- chat-extra: the held-out prompts of the third pool (`pool="extra"`: more topics and kinds of
  request, problems with numbers, standard-library method tasks), chat messages too.
- code: the held-out code tasks ("Write a Python function ..."), chat messages too.
- random: requests for made-up content (serial numbers, invented words), meant to be sampled
  at temperature 1: the workload where no drafter should pay (what `auto` must not lose on).
  Their template is used nowhere in training.
"""

from __future__ import annotations

import re

from specserve.data.chat_prompts import TOPICS, chat_prompts, code_tasks, held_out
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


def heldout_more_chat_prompts(num: int = 8) -> list[str]:
    return chat_prompts("heldout", pool="more")[:num]


def heldout_extra_chat_prompts(num: int = 8) -> list[str]:
    return chat_prompts("heldout", pool="extra")[:num]


def heldout_code_prompts(num: int = 8) -> list[str]:
    return [p for p in code_tasks(600) if held_out(p)][:num]


def random_prompts(num: int = 8) -> list[str]:
    return [f"Make up {10 + i % 3 * 5} product names about {topic}, each followed by a random "
            "twelve-character serial number of letters and digits, one per line."
            for i, topic in enumerate(TOPICS[::7][:num])]


PROMPT_SETS = {"completion": completion_prompts, "editing": editing_prompts,
               "chat": heldout_chat_prompts, "chat-more": heldout_more_chat_prompts,
               "chat-extra": heldout_extra_chat_prompts, "code": heldout_code_prompts,
               "random": random_prompts}
# user messages: rendered with the chat template
CHAT_SETS = frozenset({"chat", "chat-more", "chat-extra", "code", "random"})
