"""The chat prompt set: the held-out split is disjoint from the training split and the same on
every call; every kind of prompt is in both."""

from __future__ import annotations

import pytest

from specserve.data.chat_prompts import (EXTRA_TEMPLATES, EXTRA_TOPICS, MORE_TEMPLATES,
                                          MORE_TOPICS, TOPICS, chat_prompts, code_tasks,
                                          held_out)


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


def test_the_second_pool_is_new_prompts_split_the_same_way():
    """pool="more": new topics and new kinds of request; its held-out part is split off by the
    same hash, and no prompt of the base pool's held-out split can be in its training split."""
    train, heldout = chat_prompts("train", pool="more"), chat_prompts("heldout", pool="more")
    assert not set(train) & set(heldout)
    assert not set(train) & set(chat_prompts("heldout"))
    assert all(held_out(p) for p in heldout) and not any(held_out(p) for p in train)
    assert len(set(train) & set(chat_prompts("train"))) < 0.01 * len(train)   # new prompts
    assert any(any(t in p for t in MORE_TOPICS) for p in train)
    assert any(p == MORE_TEMPLATES[0].format(topic=TOPICS[0]) for p in train + heldout)
    assert any(p.startswith("Write a Python function") for p in train)
    with pytest.raises(ValueError, match="pool must be one of base, more, extra"):
        chat_prompts("train", pool="all")


def test_the_third_pool_is_new_prompts_of_new_kinds_split_the_same_way():
    """pool="extra": none of the other pools' prompts; its topics and kinds of request,
    problems with numbers and method tasks in both splits; the same prompts on every call."""
    train, heldout = chat_prompts("train", pool="extra"), chat_prompts("heldout", pool="extra")
    others = {p for pool in ("base", "more") for s in ("train", "heldout")
              for p in chat_prompts(s, pool=pool)}
    assert not set(train) & set(heldout) and not (set(train) | set(heldout)) & others
    assert len(set(train)) == len(train) and chat_prompts("heldout", pool="extra") == heldout
    assert all(held_out(p) for p in heldout) and not any(held_out(p) for p in train)
    for split in (train, heldout):
        assert any(p == EXTRA_TEMPLATES[0].format(topic=t) for t in EXTRA_TOPICS for p in split)
        assert any(p.startswith("Write the method `") and "It should do this: " in p
                   and "\n" not in p for p in split)
        assert any(p.startswith("What is ") and p[8].isdigit() for p in split)


def test_code_tasks_give_a_signature_and_a_summary_never_a_body():
    tasks = code_tasks(20)
    assert len(tasks) == 20
    for t in tasks:
        assert t.startswith("Write a Python function `") and "It should do this: " in t
        assert "\n" not in t           # the docstring's first line only


def test_benchmark_sets_are_never_trained_on():
    from specserve.data.prompts import PROMPT_SETS
    train = {p for pool in ("base", "more", "extra") for p in chat_prompts("train", pool=pool)}
    for name in ("chat", "chat-more", "chat-extra", "code", "random"):
        prompts = PROMPT_SETS[name](8)
        assert len(prompts) == 8 and not train & set(prompts), name
    assert all(p.startswith("Write a Python function") for p in PROMPT_SETS["code"](8))
