"""The backend a model runs on, chosen once when the engine is built and shared by its
drafters: CUDA, the CPU kernel (specserve/kernels/cpu), or PyTorch on the CPU (oneDNN linears
where they exist)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.models.layers import backend_name, use_decode_linears


@dataclass(frozen=True)
class Backend:
    device: torch.device
    dtype: torch.dtype
    cpu_kernel: bool            # run few-row CPU steps in the compiled kernel where it builds

    def prepare(self, model: nn.Module) -> nn.Module:
        """`model` (any device and dtype) moved to this backend's and set up for inference on
        it (packed weights for the kernel or oneDNN on the CPU)."""
        model = model.to(device=self.device, dtype=self.dtype).eval()
        return use_decode_linears(model, self.cpu_kernel)

    @staticmethod
    def describe(model: nn.Module) -> str:
        """Which path a prepared model's steps take (the engine logs it)."""
        return backend_name(model)
