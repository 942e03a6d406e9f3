"""Where the bundled zoo keeps its models."""

from __future__ import annotations

from pathlib import Path


def head_dir(target: str | Path, method: str) -> str:
    """Where the zoo keeps `method`'s head for `target`: models/code-target-eagle3, ...; for
    mtp the target plus its MTP layer (that directory is the model the engine loads)."""
    return f"{str(target).rstrip('/')}-{method.replace('_', '-')}"
