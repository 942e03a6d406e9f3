"""The offline training corpus: the running interpreter's standard-library sources.

Files are in sorted order; the last `val_fraction` of them (by count) are held out, so the
validation split is by file and the same on every machine with the same Python version.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Corpus:
    train_files: list[Path]
    val_files: list[Path]

    @classmethod
    def stdlib(cls, val_fraction: float = 0.02, limit: int | None = None) -> Corpus:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py")
                       if "site-packages" not in p.parts and "dist-packages" not in p.parts
                       and p.is_file())
        if limit is not None:
            files = files[:limit]
        n_val = max(1, int(len(files) * val_fraction))
        return cls(files[:-n_val], files[-n_val:])


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def encode_files(tokenizer, files: list[Path], eos_id: int) -> tuple[np.ndarray, int]:
    """Concatenate files as token ids separated by EOS; also return the UTF-8 byte count."""
    texts = [read_text(p) for p in files]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    ids = []
    for e in encoded:
        ids.extend(e.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16 if eos_id < 65536 else np.int32), n_bytes
