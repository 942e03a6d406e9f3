"""int8 weights (quantization="int8") and what the CPU kernel keeps resident: the int8 linear
computes the quantized products, speculation over an int8 target stays lossless, the choices
that cannot work are refused, and a loaded model holds each weight once, packed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.kernels.cpu import linear_rows, load_library, pack_weight, quantize_int8
from specserve.kernels.cpu.binding import QB
from specserve.kv_cache import KVCache
from specserve.models.cpu_backend import DecodeLinear, use_decode_linears
from specserve.models.loader import load_model
from tests.methods.test_heads import eagle3_ckpt
from tests.models.test_cpu_kernel import _step

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def _kernel_built():
    if load_library() is None:
        if shutil.which(os.environ.get("CC", "cc")):
            pytest.fail("the CPU kernel did not build although a C compiler is installed")
        pytest.skip("no C compiler: the CPU kernel cannot be built here")


def _prompts(n: int, seed: int) -> list[TokensPrompt]:
    g = torch.Generator().manual_seed(seed)
    return [TokensPrompt(prompt_token_ids=torch.randint(0, 96, (int(k),), generator=g).tolist())
            for k in torch.randint(3, 30, (n,), generator=g)]


def test_quantize_int8_is_symmetric_per_output_column():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 33, generator=g) * torch.linspace(0.01, 3, 70)[:, None]
    w[5] = 0                                                     # a zero column: scale 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (70,) and q.abs().max() == 127
    assert scale[5] == 0 and not q[5].any()
    assert torch.all((w - q.float() * scale[:, None]).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.equal(q.abs().amax(1)[scale > 0], torch.full((69,), 127, dtype=torch.int8))


def quantized_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] as the kernel quantizes it for int8 and block weights: per block of QB inputs
    (zero-padded) round(x * 127 / max|x|) in float32, and the blocks' max|x|: [T, nblk, QB]
    and [T, nblk, 1]."""
    T, inp = x.shape
    xb = torch.cat([x, x.new_zeros(T, -inp % QB)], 1).view(T, -1, QB)
    m = xb.abs().amax(-1, keepdim=True)
    return (xb * torch.where(m > 0, 127 / m, 0)).round().clamp(-127, 127), m


def _w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the int8 linear computes, in float64: the inputs quantized per block of QB
    (`quantized_inputs`), each block's integer dot product with the int8 weights times the
    block's scale, summed, times the column's scale."""
    xq, m = quantized_inputs(x)
    pad = -x.shape[1] % QB
    qb = torch.cat([q, q.new_zeros(len(q), pad)], 1).view(len(q), -1, QB)    # [out, nblk, QB]
    dots = torch.einsum("tjk,ojk->toj", xq.double(), qb.double())           # [T, out, nblk]
    return (dots * (m / 127).double().transpose(1, 2)).sum(-1) * scale.double()


def test_int8_linear_sums_the_quantized_products_and_rows_do_not_interact():
    """y = scale * sum over blocks of (block scale * int8 dot product) (+ bias), any shape, any
    row count (prompt chunks past max_rows too); a row's bits do not depend on the other rows."""
    g = torch.Generator().manual_seed(1)
    lib = load_library()
    block = lib.specserve_block()
    for out, inp in ((40, 24), (64, 100), (130, 33), (384, 96)):
        w = torch.randn(out, inp, generator=g)
        b = torch.randn(out, generator=g)
        packed = pack_weight(w, block, quantization="int8")
        tiles, in_q = -(-out // (4 * block)), -(-inp // QB) * QB
        assert packed.dtype == torch.int8 and packed.shape == (tiles, (in_q + 4) * 4 * block)
        q, scale = quantize_int8(w)
        for rows in (1, 3, 5, 7, 13, 101, 600):
            x = torch.randn(rows, inp, generator=g) * torch.rand(rows, 1, generator=g)
            x[0, :QB] = 0                                        # an all-zero block: scale 0
            ref = _w8a8(x, q, scale)
            for bias in (None, b):
                y = linear_rows(lib, x, packed, bias, out)
                want = ref if bias is None else ref + bias.double()
                torch.testing.assert_close(y, want.float(), atol=1e-5, rtol=1e-5)
                assert torch.equal(y[-1:], linear_rows(lib, x[-1:], packed, bias, out))
        x = torch.randn(3, inp, generator=g)
        exact = (x.double() @ q.double().T) * scale.double()
        y = linear_rows(lib, x, packed, None, out).double()
        assert (y - exact).norm() < 0.05 * exact.norm()          # close to unquantized inputs


def test_an_int8_model_packs_every_linear_and_stays_close_to_float32(llama_dir):
    ids = _prompts(1, seed=2)[0]["prompt_token_ids"]
    logits = []
    for quantization in ("int8", None):
        model = use_decode_linears(load_model(llama_dir, torch.float32, torch.device("cpu")),
                                   quantization=quantization)
        linears = [m for m in model.modules() if isinstance(m, DecodeLinear)]
        assert all(m.weight is None for m in linears)     # only the packed copy is kept
        if quantization:
            assert {m.kernel_weight.dtype for m in linears} == {torch.int8}
            assert all(layer.cpu_layer.shape.mode == 3 for layer in model.layers)
        a = model.args
        cache = KVCache(a.num_hidden_layers, 1, a.num_key_value_heads, 64, a.head_dim,
                        torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            logits.append(model.compute_logits(_step(model, cache, [ids], [0], [0])))
    err = (logits[0] - logits[1]).norm() / logits[1].norm()
    assert 0 < err < 0.05                  # quantized (not the same), but close


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_over_an_int8_target_equals_its_own_decoding(dtype, llama_dir, draft_dir,
                                                                 tmp_path):
    """Lossless relative to the quantized target: greedy output with each drafter (itself int8
    or not) equals the int8 target's without speculation, alone and beside sampled requests."""
    ps = _prompts(6, seed=3)
    base = LLM(str(llama_dir), device="cpu", dtype=dtype, quantization="int8")
    ref = [o.outputs[0].token_ids for o in base.generate(ps, GREEDY, use_tqdm=False)]
    f32 = LLM(str(llama_dir), device="cpu", dtype=dtype)
    assert ref != [o.outputs[0].token_ids for o in f32.generate(ps, GREEDY, use_tqdm=False)]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1, max_tokens=10)] * 3
    specs = [{"method": "ngram", "prompt_lookup_min": 1},
             {"method": "draft_model", "model": str(draft_dir), "quantization": "int8"},
             {"method": "draft_model", "model": str(draft_dir)},
             {"method": "eagle3", "model": str(eagle3_ckpt(tmp_path / "e3"))}]
    for spec in specs:
        llm = LLM(str(llama_dir), device="cpu", dtype=dtype, quantization="int8",
                  speculative_config=spec | {"num_speculative_tokens": 3})
        mixed = llm.generate(ps, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in mixed[::2]] == ref[::2], spec
        assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
        drafter = getattr(llm.engine.proposer, "model", None)
        if drafter is not None:          # the drafter follows its own `quantization`
            int8 = drafter.layers[0].mlp.down_proj.kernel_weight.dtype == torch.int8
            assert int8 == ("quantization" in spec), spec


def test_a_float_target_may_draft_with_an_int8_drafter(llama_dir, draft_dir):
    ps = _prompts(3, seed=4)
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device="cpu").generate(
        ps, GREEDY, use_tqdm=False)]
    llm = LLM(str(llama_dir), device="cpu", speculative_config={
        "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3,
        "quantization": "int8"})
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == ref
    assert llm.engine.model.layers[0].mlp.down_proj.kernel_weight.dtype != torch.int8
    assert llm.engine.proposer.model.layers[0].mlp.down_proj.kernel_weight.dtype == torch.int8


def test_what_int8_cannot_do_is_refused_with_what_to_change(llama_dir):
    with pytest.raises(ValueError, match="quantization='int4' is not supported; use one of int8"):
        LLM(str(llama_dir), device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="needs the CPU kernel"):
        LLM(str(llama_dir), device="cpu", quantization="int8", cpu_kernel=False)
    with pytest.raises(ValueError, match="speculative_config quantization='fp8'"):
        LLM(str(llama_dir), device="cpu", speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"})


_RESIDENT = r"""
import gc, json, sys
import torch
from specserve import LLM
from specserve.bench.probes import resident_bytes
from specserve.models.backend import release_freed_memory
torch.set_num_threads(1)
LLM(sys.argv[1], device="cpu", max_num_seqs=1, max_model_len=64)   # warm: libraries, kernel
gc.collect()
release_freed_memory()
before = resident_bytes()
llm = LLM(sys.argv[1], device="cpu", max_num_seqs=1, max_model_len=64, **json.loads(sys.argv[2]))
grown = resident_bytes() - before
m = llm.engine.model
packed = sum(x.kernel_weight.nbytes for x in m.modules()
             if getattr(x, "kernel_weight", None) is not None)
# what must be resident: the packed weights, the KV cache, the embedding table
needed = packed + m.embed_tokens.weight.nbytes + sum(
    k.nbytes + v.nbytes for k, v in llm.engine.cache.layers)
print(json.dumps({"grown": grown, "needed": needed, "packed": packed}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kwargs", [{"dtype": "float32"}, {"dtype": "bfloat16"},
                                    {"dtype": "bfloat16", "quantization": "int8"}])
def test_a_loaded_model_holds_its_packed_weights_and_little_else(kwargs, tmp_path):
    """Resident memory added by loading a 0.14B-parameter bfloat16 checkpoint: at most 1.2x
    what it needs (packed weights, embedding table, KV cache), in any dtype; the kernel path
    used to keep a float32 copy of every weight beside the packed one (2-3x that)."""
    from specserve.bench.random_models import materialize
    target = materialize("random:hidden=1024,layers=8,inter=4096,heads=8,kv=4",
                         REPO / "models" / "code-target", root=tmp_path)
    out = subprocess.run([sys.executable, "-c", _RESIDENT, target, json.dumps(kwargs)],
                         capture_output=True, text=True, check=True, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    linear_params = 8 * 1024 * (2048 + 1024 + 2 * 4096 + 4096) + 8192 * 1024
    per_weight = 1 if kwargs.get("quantization") else 2          # + int8's column scales
    assert linear_params * per_weight <= r["packed"] < linear_params * per_weight * 1.01
    assert r["grown"] <= 1.2 * r["needed"], r
