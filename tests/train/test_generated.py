"""Target-generated training text: its share, its cache, its openings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specserve.data.corpus import read_text
from specserve.train.generated import GeneratedData, corpus_openings, mix_generated


def test_generated_share_of_the_training_text():
    corpus, gen = np.arange(900), np.arange(1000, 1010)
    assert len(mix_generated(corpus, gen, 0.0)) == 910                  # appended once
    mixed = mix_generated(corpus, gen, 0.25)
    share = (mixed >= 1000).mean()
    assert 0.25 <= share < 0.26 and (mixed[:900] == corpus).all()
    with pytest.raises(ValueError, match=r"generated_share must be in \[0, 1\)"):
        GeneratedData(generated_share=1.0)


def test_greedy_continuations_extend_a_smaller_cache(monkeypatch, tmp_path):
    """More greedy continuations than a work directory holds: only the new openings are
    generated, after the cached ones; sampled ones are generated whole."""
    import specserve.train.generated as generated
    calls = []

    def fake(target_dir, corpus, num, length, seed, temperature, skip=0):
        calls.append((num, skip))
        return np.arange(skip, num) * 10           # one "token" per continuation
    monkeypatch.setattr(generated, "generated_tokens", fake)
    np.save(tmp_path / "generated-3x16-t0.npy", np.array([0, 10, 20]))
    np.save(tmp_path / "generated-9x16-t0.npy", np.array([-1]))            # a larger one: unused
    ids = generated.with_generated(np.zeros(0, dtype=np.int64), GeneratedData(
        num_generated=5, generated_len=16, generated_temperature=0), Path("t"), None, tmp_path, 0)
    assert calls == [(5, 3)] and ids.tolist() == [0, 10, 20, 30, 40]
    assert np.load(tmp_path / "generated-5x16-t0.npy").tolist() == [0, 10, 20, 30, 40]
    np.save(tmp_path / "generated-3x16-t0.7.npy", np.array([0, 10, 20]))
    generated.with_generated(np.zeros(0, dtype=np.int64), GeneratedData(
        num_generated=5, generated_len=16, generated_temperature=0.7), Path("t"), None,
        tmp_path, 0)
    assert calls[-1] == (5, 0)


def test_more_openings_than_files_start_at_later_lines(small_corpus):
    """Past one opening per file, later ones start at line starts further into the files; the
    first pass is each non-empty file's beginning (as the zoo recipe had)."""
    files = [f for f in small_corpus.train_files if read_text(f).strip()]
    ops = corpus_openings(small_corpus, 3 * len(files), seed=0)
    assert len(ops) == 3 * len(files)
    assert sorted(ops[:len(files)]) == sorted(read_text(f)[:400] for f in files)
    later = ops[len(files):]
    assert not set(later) & set(ops[:len(files)])
    assert all(any(("\n" + o) in read_text(f) for f in files) for o in later)
    assert corpus_openings(small_corpus, 5, seed=0) == ops[:5]
