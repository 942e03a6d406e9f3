"""llama.cpp's blocks in the CPU kernel (quantization="q4_0", "q4_1", "q8_0"): the linear
computes the dequantized blocks' products with the inputs quantized as for int8, rows do not
interact, a GGUF's own blocks are what the kernel holds, and speculation over a 4-bit target
stays lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from specserve import LLM, SamplingParams
from specserve.kernels.cpu import BLOCK_TYPES, linear_rows, pack_weight, quantize_blocks
from specserve.kernels.cpu.binding import QB, weight_mode
from specserve.models.cpu_backend import DecodeLinear
from tests.methods.test_heads import eagle3_ckpt
from tests.models.test_quantization import (  # noqa: F401
    GREEDY,
    _kernel_built,
    _prompts,
    quantized_inputs,
)


def _dequantized(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The weights the blocks hold, [out, in padded to QB], by llama.cpp's own rule (gguf)."""
    values, d, m = quantize_blocks(w, kind)
    parts = [d.view(np.uint8).reshape(*d.shape, 2)]                  # a file's block layout
    if kind == "q4_1":
        parts.append(m.view(np.uint8).reshape(*m.shape, 2))
    parts.append(values if kind != "q8_0" else (values.astype(np.int16) - 128).astype(np.uint8))
    raw = np.concatenate(parts, -1).reshape(len(w), -1)
    qtype = GGMLQuantizationType[BLOCK_TYPES[kind]]
    return torch.from_numpy(dequantize(raw, qtype)).view(len(w), -1)


def _reference(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """In float64: each block of QB inputs quantized as the kernel does (round(x * 127 /
    max|x|)) times the dequantized weights, summed over the blocks."""
    xq, m = quantized_inputs(x)
    return (xq * (m / 127)).view(len(x), -1).double() @ _dequantized(w, kind).double().T


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_block_linear_sums_the_dequantized_products_and_rows_do_not_interact(kind):
    from specserve.kernels.cpu import load_library
    lib = load_library()
    g = torch.Generator().manual_seed(1)
    for out, inp, rows in ((100, 70, 1), (257, 576, 5), (64, 32, 7), (3, 1000, 13)):
        w = torch.randn(out, inp, generator=g)
        w[0, :QB] = 0                                       # an all-zero block: d = 0
        x = torch.randn(rows, inp, generator=g)
        packed = pack_weight(w, lib.specserve_block(), quantization=kind)
        assert weight_mode(packed) == (5 if kind == "q8_0" else 4)
        y = linear_rows(lib, x, packed, None, out)
        ref = _reference(x, w, kind)
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5, (out, inp, rows)
        for t in range(rows):          # bit for bit the row alone: batch invariance
            assert torch.equal(linear_rows(lib, x[t:t + 1], packed, None, out)[0], y[t])
    # the largest integer sums a block can give: (nearly) every nibble 15 or every Q8 value
    # +-127, every input +-127 (the AVX2 products add byte pairs in saturating 16-bit lanes)
    w = torch.full((40, 96), -7 / 8 if kind == "q4_0" else 1.0)
    w[:, ::QB] = 1.0 if kind == "q4_0" else 0.0                   # the block's anchor value
    w[1::2] = -w[1::2]
    packed = pack_weight(w, lib.specserve_block(), quantization=kind)
    for x in (torch.ones(3, 96), -torch.ones(3, 96)):
        y = linear_rows(lib, x, packed, None, len(w))
        ref = _reference(x, w, kind)
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    # 4-bit blocks hold the weights to within half a step of their block's range
    w = torch.randn(64, 256, generator=g)
    err = (_dequantized(w, kind)[:, :256] - w).abs().max()
    assert 0 < err < (0.03 if kind == "q8_0" else 0.5)


def test_the_kernel_holds_a_gguf_s_own_blocks(smollm2):
    """SmolLM2's file (Q4_1 linears, a Q8_0 embedding): its blocks, dequantized at load and
    quantized again, are the file's bytes, so quantization="q4_1" runs the file llama.cpp
    runs (its Q8_0 embedding as the q8_0 vocabulary projection)."""
    reader = GGUFReader(smollm2)
    tensors = {t.name: t for t in reader.tensors}
    for name, kind in (("blk.3.ffn_down.weight", "q4_1"), ("blk.0.attn_v.weight", "q4_1"),
                       ("token_embd.weight", "q8_0")):
        t = tensors[name]
        raw = np.asarray(t.data).reshape(t.data.shape[0], -1, 20 if kind == "q4_1" else 34)
        w = torch.from_numpy(dequantize(np.asarray(t.data), t.tensor_type))
        values, d, m = quantize_blocks(w, kind)
        assert np.array_equal(d.view(np.uint8).reshape(raw.shape[:2] + (2,)), raw[..., :2])
        if kind == "q4_1":
            assert np.array_equal(m.view(np.uint8).reshape(raw.shape[:2] + (2,)), raw[..., 2:4])
            assert np.array_equal(values, raw[..., 4:])
        else:
            assert np.array_equal(values.astype(np.int16) - 128, raw[..., 2:].view(np.int8))


def test_a_q4_smollm2_stays_close_to_its_dequantized_weights(smollm2):
    """The same weights in float32 (the file dequantized) and in the kernel's Q4_1 blocks:
    only the inputs' 8-bit rounding differs, so the next-token distributions agree (about as
    closely as int8's requantized weights: within 0.2 nats over the top 5 here)."""
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = {}
    for q in (None, "q4_1"):
        llm = LLM("smollm2-135m-instruct", quantization=q, max_model_len=256, max_num_seqs=1)
        if q:
            linears = [m for m in llm.engine.model.modules() if isinstance(m, DecodeLinear)]
            assert {weight_mode(m.kernel_weight) for m in linears} == {4, 5}
            assert weight_mode(llm.engine.model.lm_head.kernel_weight) == 5
        outs[q] = llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0].logprobs[0]
        del llm
    assert next(iter(outs[None])) == next(iter(outs["q4_1"]))            # the same argmax
    shared = set(outs[None]) & set(outs["q4_1"])
    assert len(shared) >= 4
    assert max(abs(outs[None][t] - outs["q4_1"][t]) for t in shared) < 0.3


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_speculation_over_a_block_quantized_target_equals_its_own_decoding(kind, llama_dir,
                                                                           draft_dir, tmp_path):
    """Lossless relative to the quantized target: greedy and seeded outputs with n-gram lookup,
    a 4-bit draft model and a 4-bit EAGLE-3 head equal the target's own; the lm_head is q8_0
    with q4_0."""
    ps = _prompts(6, seed=5)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=12)] * 3
    base = LLM(str(llama_dir), device="cpu", quantization=kind)
    model = base.engine.model
    assert all(layer.cpu_layer.shape.mode == (5 if kind == "q8_0" else 4)
               for layer in model.layers)
    assert weight_mode(model.lm_head.kernel_weight) == 5
    ref = [o.outputs[0].token_ids for o in base.generate(ps, params, use_tqdm=False)]
    f32 = LLM(str(llama_dir), device="cpu").generate(ps, params, use_tqdm=False)
    assert ref != [o.outputs[0].token_ids for o in f32]
    for spec in ({"method": "ngram", "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": str(draft_dir), "quantization": "q4_0"},
                 {"method": "eagle3", "model": str(eagle3_ckpt(tmp_path / "e3")),
                  "quantization": "q4_0"}):
        llm = LLM(str(llama_dir), device="cpu", quantization=kind,
                  speculative_config=spec | {"num_speculative_tokens": 3})
        got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        assert got == ref, spec
        assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
