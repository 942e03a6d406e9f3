"""Tokenizer files, chat template and the incremental detokenizer."""

from specserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "def café():\n    return '🚀 ünïcode' + \"ok\"\n"


def test_round_trip_and_specials(text_model_dir):
    tok = Tokenizer(text_model_dir)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None


def test_incremental_detokenizer_never_splits_characters(text_model_dir):
    tok = Tokenizer(text_model_dir)
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 4     # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, tok.encode("x = 1\n"))
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) + detok.flush() == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_flush_returns_an_incomplete_tail(text_model_dir):
    tok = Tokenizer(text_model_dir)
    ids = tok.encode("😀")          # not in the tiny tokenizer's corpus: one token per byte
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    partial = "".join(detok.add([t]) for t in ids[:-1])
    assert partial == "" and detok.flush() == "\ufffd"


def test_chat_template(text_model_dir):
    tok = Tokenizer(text_model_dir)
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
