"""The CPU backends' module variants (models/cpu_backend.py): packed linears, and the kernel's
norms, layers and whole steps swapped in for a model's plain modules."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.cpu import HeadChain, LlamaChain, load_library
from specserve.methods import eagle3
from specserve.models.cpu_backend import (
    DecodeLinear,
    KernelLayer,
    KernelLlama,
    KernelRMSNorm,
    compiled_chain,
    use_decode_linears,
)
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model

kernel = pytest.mark.skipif(load_library() is None, reason="no C compiler for the CPU kernel")


def test_decode_linear_matches_linear():
    import torch as t
    libs = [None] + ([load_library()] if load_library() is not None else [])
    for bias, lib in ((b, lib) for b in (False, True) for lib in libs):
        lin = t.nn.Linear(24, 40, bias=bias)
        dl = DecodeLinear(lin, lib)
        # the kernel keeps only its packed copy; oneDNN the Parameter (ties stay tied)
        assert dl.weight is (None if lib is not None else lin.weight)
        for x in (t.randn(1, 24), t.randn(7, 24), t.randn(2, 5, 24), t.randn(6, 24)[::2],
                  t.randn(600, 24), t.randn(2, 300, 24)):   # the last two: past max_rows
            assert t.allclose(dl(x), lin(x), atol=1e-5)
    seq = use_decode_linears(t.nn.Sequential(t.nn.Linear(4, 4), t.nn.ReLU(), t.nn.Linear(4, 2)))
    assert [type(m).__name__ for m in seq] == ["DecodeLinear", "ReLU", "DecodeLinear"]
    half = use_decode_linears(t.nn.Sequential(t.nn.Linear(4, 4)).half())
    assert type(half[0]).__name__ == "Linear"                # no packed float16 kernel


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this CPU has no native bfloat16: bfloat16 keeps nn.Linear")
def test_bfloat16_decode_linear_matches_linear():
    for bias in (False, True):
        lin = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
        dl = DecodeLinear(lin)
        for x in (torch.randn(1, 64), torch.randn(5, 64), torch.randn(2, 7, 64)):
            x = x.to(torch.bfloat16)
            torch.testing.assert_close(dl(x).float(), lin(x).float(), atol=2e-2, rtol=2e-2)


@kernel
def test_a_model_becomes_its_kernel_variants_in_place_with_its_parameter_names(llama_dir):
    plain = load_model(llama_dir, torch.float32, torch.device("cpu"))
    assert compiled_chain(plain, []) is None                     # plain modules: no kernel
    names = [n for n, _ in plain.named_parameters() if "proj" not in n and "lm_head" not in n]
    model = use_decode_linears(plain)
    assert model is plain and type(model) is KernelLlama and isinstance(model, LlamaForCausalLM)
    assert all(type(layer) is KernelLayer for layer in model.layers)
    assert isinstance(model.norm, KernelRMSNorm) and model.cpu_forward is not None
    assert [n for n, _ in model.named_parameters()] == names    # packed weights: not params
    layer = model.layers[0]
    assert use_decode_linears(model) is model and model.layers[0] is layer    # once is enough
    assert type(layer) is KernelLayer
    a = model.args
    caches = [(torch.zeros(2, a.num_key_value_heads, 32, a.head_dim),) * 2
              for _ in range(a.num_hidden_layers)]
    assert isinstance(compiled_chain(model, caches), LlamaChain)


@kernel
def test_a_head_layer_subclass_gets_its_own_variant_and_chain(llama_dir):
    target = use_decode_linears(load_model(llama_dir, torch.float32, torch.device("cpu")))
    head = use_decode_linears(eagle3.new_head(target, 3))
    layer = head.layers[0]
    assert type(layer).__name__ == "KernelEagle3DecoderLayer"
    assert isinstance(layer, eagle3.Eagle3DecoderLayer) and isinstance(layer, KernelLayer)
    assert type(use_decode_linears(eagle3.new_head(target, 3)).layers[0]) is type(layer)
    a = head.args
    cache = (torch.zeros(2, a.num_key_value_heads, 32, a.head_dim),) * 2
    assert isinstance(compiled_chain(head, [cache]), HeadChain)
    layer.cpu_layer = None          # a variant without its C layer: no compiled chain
    assert compiled_chain(head, [cache]) is None
