"""The CLI parses, dispatches and prints (run in-process)."""

from __future__ import annotations

import pytest

from specserve.cli import main


def test_generate_prints_completion_and_speed(text_model_dir, capsys):
    main(["generate", str(text_model_dir), "--prompt", "def add", "--max-tokens", "8",
          "--device", "cpu", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert out.startswith("def add")
    assert "8 tokens in" in err and "tokens/s" in err


def test_generate_with_speculation_prints_acceptance(text_model_dir, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("method: ngram\nnum_speculative_tokens: 3\nprompt_lookup_min: 1\n")
    main(["generate", str(text_model_dir), "--prompt", "hello hello hello", "--max-tokens", "8",
          "--device", "cpu", "--speculative-config", f"@{spec}"])
    assert "mean acceptance length" in capsys.readouterr().err


def test_bad_speculative_config_exits_with_message(text_model_dir):
    with pytest.raises(SystemExit, match="unknown speculative_config key 'k'"):
        main(["generate", str(text_model_dir), "--prompt", "x", "--device", "cpu",
              "--speculative-config", '{"method": "ngram", "k": 2}'])


def test_missing_model_dir_exits_with_message(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["generate", str(tmp_path / "none"), "--prompt", "x"])
