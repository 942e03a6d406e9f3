"""The offline corpus: its split."""

from __future__ import annotations

from specserve.data.corpus import Corpus


def test_corpus_split_is_by_file_and_deterministic():
    a, b = Corpus.stdlib(), Corpus.stdlib()
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert not set(a.train_files) & set(a.val_files)
    assert all("site-packages" not in p.parts for p in a.train_files + a.val_files)
