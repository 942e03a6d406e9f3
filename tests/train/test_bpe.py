"""The BPE tokenizer trained on the corpus."""

from __future__ import annotations

from specserve.data.corpus import read_text
from specserve.train.bpe import train_bpe


def test_tokenizer_round_trips_corpus_files(small_corpus):
    tok = train_bpe(small_corpus.train_files, vocab_size=600)
    for path in small_corpus.train_files[:4] + small_corpus.val_files:
        text = read_text(path)
        assert tok.decode(tok.encode(text).ids) == text
