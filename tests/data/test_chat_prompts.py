"""The chat prompt set: the held-out split is disjoint from the training split and the same on
every call; every kind of prompt is in both."""

from __future__ import annotations

import pytest

from specserve.data.chat_prompts import TOPICS, chat_prompts, code_tasks, held_out


def test_splits_are_disjoint_fixed_and_mixed():
    train, heldout = chat_prompts("train"), chat_prompts("heldout")
    assert not set(train) & set(heldout)
    assert chat_prompts("heldout") == heldout
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15
    for split in (train, heldout):
        assert any(p.startswith("Write a Python function") for p in split)
        assert any(any(t in p for t in TOPICS) for p in split)
    assert all(held_out(p) for p in heldout) and not any(held_out(p) for p in train)
    with pytest.raises(ValueError, match="split must be 'train' or 'heldout'"):
        chat_prompts("test")


def test_code_tasks_give_a_signature_and_a_summary_never_a_body():
    tasks = code_tasks(20)
    assert len(tasks) == 20
    for t in tasks:
        assert t.startswith("Write a Python function `") and "It should do this: " in t
        assert "\n" not in t           # the docstring's first line only


def test_benchmark_sets_are_never_trained_on():
    from specserve.data.prompts import PROMPT_SETS
    train = set(chat_prompts("train"))
    for name in ("chat", "code", "random"):
        prompts = PROMPT_SETS[name](8)
        assert len(prompts) == 8 and not train & set(prompts), name
    assert all(p.startswith("Write a Python function") for p in PROMPT_SETS["code"](8))
