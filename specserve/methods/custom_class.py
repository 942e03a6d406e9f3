"""custom_class: a user's proposer class named by its dotted import path in 'model' (vLLM's
`custom_class`; a dotted path with no method means this method too).

The class is built as `cls(config: SpeculativeConfig, ctx: DraftContext)` and must implement
the `Proposer` protocol (methods/base.py); subclassing `ProposerBase` gives the members it
does not need. Verification keeps the output lossless whatever it drafts.
"""

from __future__ import annotations

import importlib
import re

from specserve.config import SpeculativeConfig
from specserve.methods.base import DraftContext, MethodSpec, Proposer

# everything the engine reads from a proposer (the Proposer protocol)
REQUIRED = ("propose", "finish", "reset", "stats", "aux_hidden_layers", "caches",
            "max_model_len", "modules")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def is_dotted_path(model: str | None) -> bool:
    return model is not None and bool(_DOTTED.match(model))


def build(config: SpeculativeConfig, ctx: DraftContext) -> Proposer:
    path = config.model or ""
    if not is_dotted_path(path):
        raise ValueError(f"custom_class needs 'model' to be a dotted import path such as "
                         f"'my_package.my_module.MyProposer', got {path!r}")
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"custom_class: could not import {path!r} ({e}); check that its "
                         "module is importable (on PYTHONPATH) and defines the class") from None
    proposer = cls(config, ctx)
    missing = [name for name in REQUIRED if not hasattr(proposer, name)]
    if missing:
        raise ValueError(f"custom_class {path!r} does not implement the Proposer protocol: "
                         f"it lacks {', '.join(missing)} (subclass "
                         "specserve.methods.base.ProposerBase for the defaults)")
    return proposer


SPEC = MethodSpec(name="custom_class", build=build, needs_model=True, in_benchmarks=False,
                  summary="your own proposer class, by its dotted import path")
