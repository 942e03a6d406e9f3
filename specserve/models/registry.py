"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from specserve.models.llama import ARCHITECTURES, LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {name: LlamaForCausalLM for name in ARCHITECTURES}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[architecture]
