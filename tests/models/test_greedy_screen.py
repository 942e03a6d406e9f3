"""The int8 screen of a vocabulary projection's greedy rows (GreedyScreen, DecodeLinear.
greedy_logits): exact logits wherever a row's largest may be, so the argmax is the full
product's, ties and fallbacks included; the engine's greedy output is the same with it."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kernels.cpu import GreedyScreen, linear_rows, load_library, pack_weight
from specserve.models import cpu_backend


@pytest.fixture(autouse=True)
def _kernel_built():
    if load_library() is None:
        if shutil.which(os.environ.get("CC", "cc")):
            pytest.fail("the CPU kernel did not build although a C compiler is installed")
        pytest.skip("no C compiler: the CPU kernel cannot be built here")


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "pairs"])
def test_screen_gives_the_full_products_argmax_and_exact_candidates(kind):
    """Every packing the screen reads (float32, bfloat16 weights, bfloat16 pairs with inputs
    rounded), an odd input width, exact ties (the first column wins, as in torch.argmax),
    rows of different scales; the finite entries are the full product's bits."""
    lib, g = load_library(), torch.Generator().manual_seed(0)
    out, inp = 20000, 300
    w = torch.randn(out, inp, generator=g) * 0.05
    if kind == "float32":
        w += 1e-9 * torch.randn(out, inp, generator=g)          # not bfloat16-exact
    else:
        w = w.to(torch.bfloat16).float()
    w[901] = w[17]                                              # two columns tie exactly
    packed = pack_weight(w, lib.specserve_block(), pairs=kind == "pairs")
    screen = GreedyScreen(lib, w, packed)
    x = torch.randn(7, inp, generator=g) * torch.tensor([1, 10, 0.1, 1, 1, 3, 1])[:, None]
    x[3] = 30 * w[17]                                           # its largest: 17 and 901
    full = linear_rows(lib, x, packed, None, out)
    y = screen(x)
    assert torch.equal(y.argmax(1), full.argmax(1))
    assert y.argmax(1)[3] == 17
    finite = torch.isfinite(y)
    assert torch.equal(y[finite], full[finite])
    assert (screen.candidates < 200).all()                      # it did screen
    assert (finite.sum(1) == screen.candidates).all()


def test_screen_computes_a_row_whole_where_it_cannot_narrow_it():
    """A zero row (every logit ties) and a NaN row take the whole product; the others still
    screen."""
    lib, g = load_library(), torch.Generator().manual_seed(1)
    w = (torch.randn(18000, 256, generator=g) * 0.05).to(torch.bfloat16).float()
    packed = pack_weight(w, lib.specserve_block())
    screen = GreedyScreen(lib, w, packed)
    x = torch.randn(3, 256, generator=g)
    x[0] = 0
    x[2, 5] = float("nan")
    full = linear_rows(lib, x, packed, None, 18000)
    y = screen(x)
    assert screen.candidates.tolist()[0] == screen.candidates.tolist()[2] == 18000
    assert screen.candidates[1] < 200
    assert torch.equal(y[0], full[0]) and torch.equal(y[2].isnan(), full[2].isnan())
    assert torch.equal(y.argmax(1), full.argmax(1))


def test_smollm2_greedy_output_is_the_same_with_and_without_the_screen(smollm2, monkeypatch):
    """SmolLM2 in bfloat16 (its lm_head screened) decodes the same tokens as with the full
    product, plain and with EAGLE-3 drafts; a request with logprobs gets the full logits."""
    prompts = ["Explain how a bicycle works.", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 2}
    outs = {}
    for screened in (True, False):
        if not screened:
            monkeypatch.setattr(cpu_backend, "SCREEN_MIN_VOCAB", 10**9)
        for s in (None, spec):
            llm = LLM(str(smollm2), dtype="bfloat16", speculative_config=s)
            assert (llm.engine.model.lm_head.screen is not None) == screened
            outs[screened, s is None] = [o.outputs[0].token_ids
                                         for o in llm.generate(prompts, params, use_tqdm=False)]
            if screened and s is None:
                n = llm.engine.model.lm_head.screen.candidates
                assert len(n) and (n < 1000).all()                  # the last step screened
                lp = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4,
                                                             logprobs=3), use_tqdm=False)[0]
                assert all(len(d) == 3 and all(math.isfinite(v) for v in d.values())
                           for d in lp.outputs[0].logprobs)
    assert outs[True, True] == outs[False, True] == outs[True, False] == outs[False, False]
