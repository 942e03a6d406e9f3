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


def test_generate_quantized_to_int8_logs_its_backend(text_model_dir, capsys, caplog):
    import logging

    from specserve.kernels.cpu import load_library
    if load_library() is None:
        pytest.skip("int8 runs in the CPU kernel, which needs a C compiler")
    with caplog.at_level(logging.INFO, logger="specserve"):
        main(["generate", str(text_model_dir), "--prompt", "def add", "--max-tokens", "4",
              "--device", "cpu", "--quantization", "int8", "--ignore-eos"])
    assert capsys.readouterr().out.startswith("def add")
    assert "int8 weights" in caplog.text


def test_bad_speculative_config_exits_with_message(text_model_dir):
    with pytest.raises(SystemExit, match="unknown speculative_config key 'k'"):
        main(["generate", str(text_model_dir), "--prompt", "x", "--device", "cpu",
              "--speculative-config", '{"method": "ngram", "k": 2}'])


def test_missing_model_dir_exits_with_message(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["generate", str(tmp_path / "none"), "--prompt", "x"])


def test_train_lm_and_draft_commands(tmp_path, capsys, monkeypatch):
    """The train commands wire flags to the trainer (a tiny run on a few corpus files)."""
    import json

    from specserve.data import corpus as corpus_mod
    small = corpus_mod.Corpus.stdlib()
    small = corpus_mod.Corpus(small.train_files[:6], small.val_files[:1])
    monkeypatch.setattr(corpus_mod.Corpus, "stdlib", classmethod(lambda cls, **kw: small))
    size = ["--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
            "--intermediate-size", "64", "--steps", "4", "--batch-size", "2", "--seq-len", "32",
            "--warmup", "1", "--eval-every", "4", "--no-bf16", "--device", "cpu"]
    main(["train", "lm", "--out", str(tmp_path / "lm"), "--work-dir", str(tmp_path / "w1"),
          "--vocab-size", "300"] + size)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_bits_per_byte"] > 0
    main(["train", "draft", "--target", str(tmp_path / "lm"), "--out", str(tmp_path / "d"),
          "--work-dir", str(tmp_path / "w2")] + size)
    assert (tmp_path / "d" / "config.json").is_file()


@pytest.mark.parametrize("args", [
    ["eagle3", "--draft-vocab-size", "64"],                          # no --init
    ["eagle3", "--init", "h"],                                       # no new vocabulary size
    ["medusa", "--init", "h", "--draft-vocab-size", "64"]])          # not eagle3
def test_refresh_draft_vocab_needs_eagle3_init_and_size(args, tmp_path):
    with pytest.raises(SystemExit, match="--refresh-draft-vocab is for eagle3 with --init"):
        main(["train", *args, "--target", "t", "--out", str(tmp_path / "o"),
              "--refresh-draft-vocab"])
