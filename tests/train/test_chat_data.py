"""specserve train chat-data: a chat model's answers and hidden states, batch by batch, and a
run that resumes without redoing a finished batch; its files train a head."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main
from specserve.train.chat_data import ChatDataConfig, generate_chat_data
from specserve.train.heads import read_hidden_states


def test_answers_and_states_are_written_and_a_rerun_resumes(text_model_dir, tmp_path, capsys):
    out = tmp_path / "data"
    cfg = ChatDataConfig(num_prompts=3, answer_batch_size=4, answer_max_tokens=6)
    summary = generate_chat_data(str(text_model_dir), out, cfg)
    assert summary["conversations"] == 6 == summary["hidden_state_files"]  # 3 prompts x 2 temps
    batches = sorted((out / "states").iterdir())
    assert [b.name for b in batches] == ["batch-00000", "batch-00001"]
    answers = [json.loads(line) for b in batches
               for line in (b / "answers.jsonl").read_text().splitlines()]
    assert sorted({a["temperature"] for a in answers}) == [0.0, 0.7]
    states, layers = read_hidden_states(out / "states")
    assert len(states) == 6 and len(layers) == 3
    for s in states:     # one state per position but the last token: the one it predicts
        assert s["aux_hidden"].shape[0] == s["hidden"].shape[0] == len(s["token_ids"]) - 1
    # a finished batch is not redone; a stopped one (no DONE) is
    (batches[1] / "DONE").unlink()
    stamp = (batches[0] / "answers.jsonl").stat().st_mtime_ns
    main(["train", "chat-data", "--target", str(text_model_dir), "--out", str(out),
          "--num-prompts", "3", "--answer-batch-size", "4", "--answer-max-tokens", "6"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert (batches[0] / "answers.jsonl").stat().st_mtime_ns == stamp
    assert (batches[1] / "DONE").is_file()


def test_a_run_that_fills_its_states_budget_stops_and_a_larger_one_goes_on(text_model_dir,
                                                                              tmp_path):
    """--states-max-bytes counts the files of earlier runs too; a batch whose states did not all
    fit is not marked done, the run stops naming the flag, and a rerun with room finishes it."""
    out = tmp_path / "data"
    small = ChatDataConfig(num_prompts=3, answer_batch_size=4, answer_max_tokens=6)
    generate_chat_data(str(text_model_dir), out, small)
    first = sum(f.stat().st_size for f in (out / "states").rglob("*.safetensors"))
    more = ChatDataConfig(num_prompts=5, answer_batch_size=4, answer_max_tokens=6,
                          states_max_bytes=first + 1)          # room for one more file
    # batch 1 held 2 conversations and now holds 4: it is answered again, one file fits
    with pytest.raises(RuntimeError, match=r"reached --states-max-bytes .* in batch 1 \(1 of "
                                           "its 4 .*the 1 batches before it are kept"):
        generate_chat_data(str(text_model_dir), out, more)
    assert len((out / "states" / "batch-00001" / "answers.jsonl").read_text().splitlines()) == 2
    summary = generate_chat_data(str(text_model_dir), out, ChatDataConfig(
        num_prompts=5, answer_batch_size=4, answer_max_tokens=6))
    assert summary["conversations"] == 10 == summary["hidden_state_files"]


def test_the_second_prompt_pool_is_answered_and_a_bad_pool_is_named(text_model_dir, tmp_path):
    from specserve.data.chat_prompts import chat_prompts
    out = tmp_path / "data"
    generate_chat_data(str(text_model_dir), out, ChatDataConfig(
        num_prompts=2, answer_temperatures="0", answer_batch_size=4, answer_max_tokens=4,
        prompt_pool="more"))
    lines = (out / "states" / "batch-00000" / "answers.jsonl").read_text().splitlines()
    answers = [json.loads(line) for line in lines]
    assert len(answers) == 2
    assert {a["prompt"] for a in answers} <= set(chat_prompts("train", pool="more"))
    assert not (out / "questions.json").exists()      # the target's questions are base's
    with pytest.raises(ValueError, match="--prompt-pool must be one of base, more, extra"):
        generate_chat_data(str(text_model_dir), tmp_path / "x", ChatDataConfig(prompt_pool="all"))
