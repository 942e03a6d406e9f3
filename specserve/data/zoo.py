"""Where the bundled zoo keeps its models."""

from __future__ import annotations

from pathlib import Path


def head_dir(target: str | Path, method: str) -> str:
    """Where the zoo keeps `method`'s head for `target`: models/code-target-eagle3,
    models/code-target-mlp-speculator, ... (for mtp the target plus its MTP layer: that
    directory is the model the engine loads); for a catalogue name, the drafter bundled for it
    under the method's own name (smollm2-135m-instruct-mlp_speculator)."""
    t = str(target).rstrip("/")
    return f"{t}-{method.replace('_', '-') if Path(t).exists() else method}"
