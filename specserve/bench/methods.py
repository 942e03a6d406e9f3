"""What the benchmarks compare: speculation methods as speculative_config dicts, and the flags
both benchmark commands share."""

from __future__ import annotations

import argparse

METHODS = ("ngram", "suffix", "draft_model")


def spec_config(method: str, k: int, draft: str) -> dict:
    """The speculative_config a benchmark uses for `method` with K = k."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    raise SystemExit(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="models/code-target")
    p.add_argument("--draft", default="models/code-draft")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    p.add_argument("--spec-extra", default=None,
                   help="JSON merged into every speculative_config, e.g. "
                        "'{\"disable_by_batch_size\": 8}'")
    p.add_argument("--results", default="benchmarks/RESULTS.md")


def configs(a: argparse.Namespace) -> dict[str, dict]:
    """method name -> speculative_config, from the common flags."""
    import json
    extra = json.loads(a.spec_extra) if a.spec_extra else {}
    return {m: spec_config(m, a.num_speculative_tokens, a.draft) | extra
            for m in filter(None, a.methods.split(","))}
