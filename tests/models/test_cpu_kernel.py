"""The compiled CPU kernel: its linear, its batch invariance, EAGLE-3 features, the greedy
screen of a vocabulary projection, and the fallback when it cannot be built. (Its logits against transformers: test_llama.py, `kernel`.)"""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from specserve import LLM, SamplingParams
from specserve.kernels.cpu import (
    GreedyScreen,
    linear_rows,
    load_library,
    pack_weight,
    read_once,
)
from specserve.kv_cache import KVCache
from specserve.models import cpu_backend
from specserve.models.cpu_backend import KernelLayer, llama_forward, use_decode_linears
from specserve.models.loader import load_model
from specserve.models.metadata import build_metadata


@pytest.fixture(autouse=True)
def _kernel_built():
    """Built when the first test runs, not at collection; a machine with a C compiler must
    build it (a failed build is a failure, not a skip)."""
    if load_library() is None:
        if shutil.which(os.environ.get("CC", "cc")):
            pytest.fail("the CPU kernel did not build although a C compiler is installed")
        pytest.skip("no C compiler: the CPU kernel cannot be built here")


def test_linear_rows_matches_linear_for_any_shape_and_row_count():
    """Any shape, any row count; a row's bits do not depend on the other rows."""
    g = torch.Generator().manual_seed(0)
    lib = load_library()
    for out, inp in ((40, 24), (64, 100), (130, 33), (384, 96), (72, 301), (40, 600)):
        b = torch.randn(out, generator=g)
        for bf16_valued in (False, True):
            w = torch.randn(out, inp, generator=g)
            if bf16_valued:             # packed in bfloat16: half the bytes, same products
                w = w.to(torch.bfloat16).float()
            block = lib.specserve_block()
            packed = pack_weight(w, block)
            tiles = -(-out // (4 * block))
            if bf16_valued:             # inputs in pairs
                assert packed.shape == (tiles, (inp + 1) // 2, 4, 2 * block)
                padded = torch.cat([w, w.new_zeros(tiles * 4 * block - out, inp)])
                as_f32 = padded.view(-1, 4, block, inp).permute(0, 3, 1, 2).contiguous()
            else:
                assert packed.shape == (tiles, inp, 4, block)
            assert (packed.dtype == torch.bfloat16) == bf16_valued
            for rows in (1, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 48, 101):
                x = torch.randn(rows, inp, generator=g)
                for bias in (None, b):
                    y = linear_rows(lib, x, packed, bias, out)
                    torch.testing.assert_close(y, F.linear(x, w, bias), atol=1e-4, rtol=1e-4)
                    assert torch.equal(y[-1:], linear_rows(lib, x[-1:], packed, bias, out))
                    if bf16_valued:     # the float32 layout's products, summed in its order
                        assert torch.equal(y, linear_rows(lib, x, as_f32, bias, out))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's (and so the kernel's) thread count set to n, then back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_read_once_reads_every_word_of_every_tensor_once(threads):
    """The XOR of every 32-bit word read: a word read twice, or not at all, changes it (the
    tails past a multiple of 256 bytes are left out, as documented)."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
               for n in (64, 64 * 37, 64 * 1000 + 5)]
    expect = 0
    for t in tensors:
        for w in t[: t.numel() // 64 * 64].tolist():
            expect ^= w
    with torch_threads(threads):
        assert read_once(load_library(), tensors) == expect != 0
        assert read_once(load_library(), tensors[:2] + tensors[1:2]) != expect


def test_linear_rows_with_bfloat16_inputs_sums_their_exact_products():
    """Pair packing (bfloat16 models): x rounded to bfloat16 (nearest even), every product
    exact, summed in float32; a row's bits do not depend on the other rows."""
    g = torch.Generator().manual_seed(5)
    lib = load_library()
    block = lib.specserve_block()
    for out, inp in ((40, 24), (64, 100), (130, 33), (384, 96), (72, 601)):   # odd widths
        w = torch.randn(out, inp, generator=g).to(torch.bfloat16).float()
        b = torch.randn(out, generator=g)
        packed = pack_weight(w, block, pairs=True)
        assert packed.dtype == torch.bfloat16
        assert packed.shape == (-(-out // (4 * block)), (inp + 1) // 2, 4, block, 2)
        for rows in (0, 1, 3, 5, 7, 9, 13, 16, 17, 101):
            x = torch.randn(rows, inp, generator=g) * 3
            for bias in (None, b):
                y = linear_rows(lib, x, packed, bias, out)
                ref = F.linear(x.to(torch.bfloat16).double(), w.double(),
                               None if bias is None else bias.double())
                torch.testing.assert_close(y, ref.float(), atol=1e-4, rtol=1e-4)
                assert torch.equal(y[-1:], linear_rows(lib, x[-1:], packed, bias, out))
    with pytest.raises(ValueError, match="bfloat16 holds exactly"):
        pack_weight(torch.full((8, 4), 1 + 2 ** -12), block, pairs=True)


def _uses_kernel(model) -> bool:
    return all(isinstance(layer, KernelLayer) and layer.cpu_layer is not None
               for layer in model.layers)


def _stepper(path, slots: int = 4, kv_dtype: torch.dtype = torch.float32, max_len: int = 64,
             kernel: bool = True):
    model = load_model(path, torch.float32, torch.device("cpu"))
    if kernel:
        model = use_decode_linears(model)
    a = model.args
    cache = KVCache(a.num_hidden_layers, slots, a.num_key_value_heads, max_len, a.head_dim,
                    kv_dtype, torch.device("cpu"))
    return model, cache


@torch.inference_mode()
def _step(model, cache, feeds, starts, slots, aux=()):
    md, pos = build_metadata(starts, [len(f) for f in feeds], slots, torch.device("cpu"))
    return model(torch.tensor([t for f in feeds for t in f]), pos, md, cache.layers,
                 aux_layers=aux)


def test_a_row_does_not_depend_on_what_else_is_in_the_step(hf_model):
    """One request's decode row alone, and the same row beside a 5-token verify of another
    request and a third request's decode: bit-for-bit the same hidden state and KV."""
    _, path, _ = hf_model
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (12, 9, 20)]
    results = []
    for together in (False, True):
        model, cache = _stepper(path)
        assert _uses_kernel(model)
        _step(model, cache, prompts, [0, 0, 0], [0, 1, 2])          # prefill, 41 rows
        if together:
            h = _step(model, cache, [[7], [1, 2, 3, 4, 5], [9]], [12, 9, 20], [0, 1, 2])[0]
        else:
            h = _step(model, cache, [[7]], [12], [0])[0]
        results.append((h.clone(), cache.layers[-1][0][0, :, 12].clone()))
    (alone, kv_alone), (together, kv_together) = results
    assert torch.equal(alone[0], together[0]) and torch.equal(kv_alone, kv_together)


@pytest.fixture(params=["native", "avx2"])
def kernel_build(request, monkeypatch, tmp_path_factory):
    """The kernel as built for this CPU, and (on an x86 CPU with AVX-512) built for AVX2 as
    an AVX2-only machine builds it: its own vector width, tiles and register pressure."""
    if request.param == "avx2":
        from specserve.kernels.cpu.binding import cpu_flags
        flags = cpu_flags()
        if "avx2" not in flags or "avx512f" not in flags:
            pytest.skip("the native build is the only one this CPU runs, or is AVX2's")
        monkeypatch.setenv("CFLAGS", "-mno-avx512f")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "avx2"))
        lib = load_library.__wrapped__()
        assert lib.specserve_block() == 8
        monkeypatch.setattr("specserve.models.cpu_backend.load_library", lambda: lib)
    return request.param


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [{}, {"head_dim": 64, "hidden_size": 96,
                                         "num_attention_heads": 3, "num_key_value_heads": 1},
                                   {"head_dim": 24, "num_attention_heads": 4},
                                   {"head_dim": 128, "num_attention_heads": 2}])
def test_a_five_row_verify_equals_five_decodes_bit_for_bit(shape, kv_dtype, kernel_build,
                                                            tmp_path):
    """The lossless-greedy property at its root: the rows of a causal run (whose queries share
    passes over the values, each seeing one key more than the last) come out exactly as the
    same tokens decoded one at a time. head_dim 16, 64 (three query heads per KV head, as in
    the bundled target), 24 (not a multiple of the vector width) and 128 (values summed in
    several passes over the columns); the KV cache in float32 and in bfloat16. Built for AVX2
    too: there a verify's 15 queries scored 8 at a time came out one unit in the last place off
    the decode's where GCC fused a different product (as SmolLM2's greedy output showed)."""
    from tests.conftest import make_hf_model
    make_hf_model("llama", tmp_path, **shape)
    g = torch.Generator().manual_seed(3)
    prompt, feed = (torch.randint(0, 96, (n,), generator=g).tolist() for n in (37, 5))
    outs = []
    for one_by_one in (False, True):
        model, cache = _stepper(tmp_path, kv_dtype=kv_dtype)
        assert _uses_kernel(model)
        _step(model, cache, [prompt], [0], [1])
        if one_by_one:
            h = torch.cat([_step(model, cache, [[t]], [37 + i], [1]) for i, t in enumerate(feed)])
        else:
            h = _step(model, cache, [feed], [37], [1])
        outs.append((h.clone(), [k[1, :, :42].clone() for k, _ in cache.layers]))
    (h5, kv5), (h1, kv1) = outs
    assert torch.equal(h5, h1)
    assert all(torch.equal(a, b) for a, b in zip(kv5, kv1))


LONG = {"head_dim": 64, "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1,
        "max_position_embeddings": 1024}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_long_context_rows_are_exact_and_batch_invariant(kv_dtype, tmp_path):
    """A 5-row verify whose rows see 510-514 keys (32 blocks of 16 and more) equals the same
    tokens decoded one at a time bit for bit, and, in float32, follows transformers' logits;
    the 509-row prompt before it as well."""
    from tests.conftest import make_hf_model
    from tests.models.test_llama import TOL, ref_logits
    hf = make_hf_model("llama", tmp_path, **LONG)
    ids = torch.randint(0, 96, (514,), generator=torch.Generator().manual_seed(8)).tolist()
    prompt, feed = ids[:509], ids[509:]
    outs = []
    for one_by_one in (False, True):
        model, cache = _stepper(tmp_path, kv_dtype=kv_dtype, max_len=520)
        assert _uses_kernel(model)
        hp = _step(model, cache, [prompt], [0], [1])
        if one_by_one:
            h = torch.cat([_step(model, cache, [[t]], [509 + i], [1]) for i, t in enumerate(feed)])
        else:
            h = _step(model, cache, [feed], [509], [1])
        outs.append((hp, h))
    (hp5, h5), (hp1, h1) = outs
    assert torch.equal(h5, h1) and torch.equal(hp5, hp1)
    if kv_dtype == torch.float32:
        with torch.inference_mode():
            logits = model.compute_logits(torch.cat([hp1, h1]))
        assert (logits - ref_logits(hf, ids)).abs().max() <= TOL


def test_a_draft_tree_after_a_long_context_attends_as_the_pytorch_path(tmp_path):
    """A draft-tree step (its mask: context plus each node's ancestors) after 300 cached
    positions: the kernel's hidden states match the PyTorch path's."""
    from specserve.models.metadata import build_tree_metadata, tree_rows
    from tests.conftest import make_hf_model
    make_hf_model("llama", tmp_path, **LONG)
    prompt = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    parents = [-1, -1, 0, 0, 2]
    outs = []
    for kernel in (True, False):
        model, cache = _stepper(tmp_path, max_len=320, kernel=kernel)
        assert _uses_kernel(model) == kernel
        _step(model, cache, [prompt], [0], [0])
        store, rope, ctx, extra = tree_rows(300, 1, parents, len(parents))
        md = build_tree_metadata([0], [store], [ctx], [extra], torch.device("cpu"))
        with torch.inference_mode():
            outs.append(model(torch.tensor([3, 11, 12, 13, 14, 15]), torch.tensor(rope), md,
                              cache.layers))
    assert (outs[0] - outs[1]).abs().max() <= 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_draft_tree_node_equals_the_decode_of_its_path_bit_for_bit(kv_dtype, tmp_path):
    """Lossless greedy trees in every precision: a node's row sees its context and its
    ancestors at other KV positions than a decode of its path would (and its step more keys),
    yet comes out bit for bit as that decode (a bfloat16 or int8 model rounds its activations,
    which turns an ulp of difference into a different token now and then). Contexts that put
    the tree's keys in another block of 16 than the decode's, and in the same."""
    from specserve.models.metadata import build_tree_metadata, tree_rows
    from tests.conftest import make_hf_model
    make_hf_model("llama", tmp_path, **LONG)
    parents, feed = [-1, -1, 0, 0, 2, 1], [3, 11, 12, 13, 14, 15, 16]   # the last token, nodes
    for n in (37, 44, 45):
        prompt = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        model, cache = _stepper(tmp_path, kv_dtype=kv_dtype)
        _step(model, cache, [prompt], [0], [0])
        store, rope, ctx, extra = tree_rows(n, 1, parents, len(parents))
        md = build_tree_metadata([0], [store], [ctx], [extra], torch.device("cpu"))
        with torch.inference_mode():
            tree = model(torch.tensor(feed), torch.tensor(rope), md, cache.layers).clone()
        for node in range(len(parents)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            tokens = [feed[0]] + [feed[1 + i] for i in reversed(path)]
            model, cache = _stepper(tmp_path, kv_dtype=kv_dtype)
            _step(model, cache, [prompt], [0], [0])
            rows = [_step(model, cache, [[t]], [n + i], [0]) for i, t in enumerate(tokens)]
            assert torch.equal(tree[1 + node], rows[-1][0]), (n, node)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_wide_heads_attend_as_transformers_does(head_dim, tmp_path):
    """Heads wider than the kernel's one pass over the values (Llama-3-8B's and Qwen3's 128)
    decode as transformers does, one token at a time past several blocks of keys."""
    from tests.conftest import make_hf_model
    from tests.models.test_llama import TOL, Stepper, ref_logits
    hf = make_hf_model("llama", tmp_path, head_dim=head_dim, num_attention_heads=2,
                       num_key_value_heads=1)
    ids = torch.randint(0, 96, (45,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = ref_logits(hf, ids)
    s = Stepper(tmp_path, kind="kernel")
    s.run([ids[:17]], [0], [1])
    for i in range(17, 45):
        assert (s.run([[ids[i]]], [i], [1])[0][0] - ref[i]).abs().max() <= TOL, f"position {i}"


def test_the_one_call_forward_equals_the_layer_by_layer_kernel_path(hf_model):
    """LlamaForward (embedding, layers, final norm in one C call) against a C call per layer:
    the same hidden states, EAGLE-3 features and KV bit for bit, over a prompt, a ragged
    verify step and a draft-tree step (its mask and depth-rotated rows)."""
    from specserve.models.metadata import build_tree_metadata, tree_rows
    _, path, _ = hf_model
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (23, 9)]
    parents = [-1, -1, 0, 0, 2]
    outs = []
    for one_call in (True, False):
        model, cache = _stepper(path)
        assert model.cpu_forward is not None
        if not one_call:
            model.cpu_forward = None
        res = [_step(model, cache, prompts, [0, 0], [0, 2], aux=(0, 1))]
        res.append(_step(model, cache, [[5, 6, 7], [8]], [23, 9], [0, 2], aux=(1,)))
        store, rope, ctx, extra = tree_rows(10, 1, parents, len(parents))
        md = build_tree_metadata([2], [store], [ctx], [extra], torch.device("cpu"))
        with torch.inference_mode():
            res.append((model(torch.tensor([3, 11, 12, 13, 14, 15]), torch.tensor(rope), md,
                              cache.layers),))
        res.append([k[[0, 2], :, :30].clone() for k, _ in cache.layers])
        outs.append([t for step in res for t in step])
    assert len(outs[0]) == len(outs[1])
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_a_layers_two_halves_summed_outside_equal_the_whole_layer(hf_model):
    """What a tensor-parallel shard runs: the attention and MLP halves of each layer in two
    C calls, each output handed to the all-reduce before it joins the stream. With one rank
    (a reduce that leaves the sum as it is) that is the whole layer, bit for bit."""
    _, path, _ = hf_model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (14, 6)]
    outs = []
    for halves in (False, True):
        model, cache = _stepper(path)
        model.cpu_forward = None
        reduced = []
        for layer in model.layers:
            layer.all_reduce = reduced.append if halves else None
        res = [_step(model, cache, prompts, [0, 0], [0, 1]),
               _step(model, cache, [[5, 6, 7], [8]], [14, 6], [0, 1])]
        outs.append(res + [k[:2, :, :17].clone() for k, _ in cache.layers])
        assert len(reduced) == (4 * len(model.layers) if halves else 0)
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_a_shards_one_call_forward_sums_its_halves_as_the_layer_path_does(hf_model):
    """LlamaForward with a shared-memory all-reduce (here over one rank: the sums are the
    parts) runs each layer's halves and sums them inside the call: the same hidden states and
    KV bit for bit as the layer-by-layer halves, and as the whole layers."""
    from specserve.kernels.cpu import SharedMemoryAllReduce, shm_numel
    _, path, _ = hf_model
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (11, 7)]
    outs, calls = [], []
    for mode in ("one call", "layer by layer", "whole layers"):
        model, cache = _stepper(path)
        shm = torch.zeros(shm_numel(1, 4096), dtype=torch.int64).share_memory_()
        reduce = SharedMemoryAllReduce(load_library(), shm, 0, 1, 4096, lambda: None)
        for layer in model.layers:
            layer.all_reduce = None if mode == "whole layers" else reduce
        model.cpu_forward = llama_forward(model) if mode == "one call" else None
        res = [_step(model, cache, prompts, [0, 0], [0, 1]),
               _step(model, cache, [[5, 6], [8]], [11, 7], [0, 1])]
        outs.append(res + [k[:2, :, :13].clone() for k, _ in cache.layers])
        calls.append(reduce._args.seq)
    assert calls == [4 * len(model.layers)] * 2 + [0]          # two halves per layer per step
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[2]))


def test_eagle3_features_and_hidden_match_the_pytorch_path(llama_dir):
    ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = []
    calls = []
    for kernel in (False, True):
        model, cache = _stepper(llama_dir)
        if not kernel:
            model.cpu_forward = None
            for layer in model.layers:
                layer.cpu_layer = None
        else:                                   # count the one-call kernel steps
            forward = model.cpu_forward
            model.cpu_forward = lambda *a, f=forward: calls.append(1) or f(*a)
            model.cpu_forward.lib = forward.lib
        _step(model, cache, [ids[:10]], [0], [3])
        outs.append(_step(model, cache, [ids[10:]], [10], [3], aux=(0, 1)))
    assert len(calls) == 2                      # both steps of the kernel run took the kernel
    (h_ref, aux_ref), (h, aux) = outs
    assert aux.shape == aux_ref.shape == (6, 2 * model.args.hidden_size)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, aux_ref, atol=1e-5, rtol=1e-5)


def test_engine_output_is_the_same_with_and_without_the_kernel(llama_dir):
    from specserve import LLM, SamplingParams, TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 3 + n))) for n in (5, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for kernel in (True, False):
        llm = LLM(str(llama_dir), device="cpu", cpu_kernel=kernel,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        assert _uses_kernel(llm.engine.model) == kernel
        tokens[kernel] = [o.outputs[0].token_ids for o in
                          llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False]


def test_without_a_compiler_it_warns_and_the_pytorch_path_runs(monkeypatch, tmp_path,
                                                               llama_dir):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert load_library.__wrapped__() is None
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setenv("CFLAGS", "--no-such-flag")      # CFLAGS reach the compiler
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert load_library.__wrapped__() is None
    monkeypatch.setattr("specserve.models.cpu_backend.load_library", load_library.__wrapped__)
    with pytest.warns(RuntimeWarning):
        model = use_decode_linears(load_model(llama_dir, torch.float32, torch.device("cpu")))
    assert not _uses_kernel(model) and model.lm_head.lib is None


def test_a_cached_library_that_does_not_load_is_rebuilt_once(tmp_path):
    """In fresh processes (a process never loads a path twice): one builds the library, the
    file is then truncated, the next rebuilds it and runs."""
    import subprocess
    import sys
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path)}
    code = ("from specserve.kernels.cpu import load_library; "
            "print(load_library().specserve_max_rows())")
    run = lambda: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,  # noqa: E731
                                 text=True, timeout=300)
    assert run().stdout.strip() in ("48", "512")
    (cached,) = (tmp_path / "specserve" / "kernels").glob("*.so")
    cached.write_bytes(b"not a shared library")                     # a truncated build, say
    again = run()
    assert again.stdout.strip() in ("48", "512") and "could not be built" not in again.stderr
    assert cached.read_bytes()[:4] == b"\x7fELF"                    # rebuilt in place


# thresholds (0: none) that stop many of the tiny test drafters' chains early
@pytest.mark.parametrize("method, threshold", [
    ("eagle3", 0.0), ("eagle3", 0.15), ("eagle", 0.0), ("eagle", 0.9), ("mtp", 0.0),
    ("mtp", 0.1), ("draft_model", 0.0), ("draft_model", 0.05)])
def test_chain_drafting_in_one_call_drafts_what_the_loop_drafts(method, threshold, tmp_path,
                                                                llama_dir):
    """On the CPU kernel EAGLE, EAGLE-3 and MTP heads and a draft model draft their greedy
    chain in one compiled call per step (a draft model's catch-up pass in it too); the drafts
    must be the PyTorch loop's over the same kernel, at batch 1 and in batches whose budgets
    differ (requests near max_tokens), with and without a confidence threshold, and the
    output stays the target's."""
    from specserve import LLM
    from tests.conftest import make_hf_model
    from tests.methods.test_heads import (
        eagle3_ckpt,
        eagle_ckpt,
        greedy_of_several_lengths,
        mtp_target,
        record_drafts,
    )
    target = llama_dir
    if method == "eagle3":
        spec = {"model": str(eagle3_ckpt(tmp_path / "e3", seed=6))}
    elif method == "eagle":
        spec = {"method": "eagle", "model": str(eagle_ckpt(tmp_path / "eagle"))}
    elif method == "mtp":
        target, spec = mtp_target(tmp_path / "mtp"), {"method": "mtp"}
    else:       # two layers, so that the chain runs a stack
        make_hf_model("llama", tmp_path / "draft", seed=3, hidden_size=32,
                      num_hidden_layers=2, intermediate_size=64)
        spec = {"method": "draft_model", "model": str(tmp_path / "draft")}
    ps, params, ref = greedy_of_several_lengths(target, seed=21, first=5, step=4)
    drafts = {}
    for chain in (True, False):
        llm = LLM(str(target), device="cpu",
                  speculative_config=spec | {"num_speculative_tokens": 4,
                                             "draft_confidence_threshold": threshold})
        proposer = llm.engine.proposer
        assert proposer.chain is not None
        if not chain:
            proposer.chain = None
        ingests = [0]
        if method == "draft_model":     # the catch-up pass too, where it fits the kernel
            run = proposer._ingest
            proposer._ingest = lambda *a: ingests.__setitem__(0, ingests[0] + 1) or run(*a)
        record = record_drafts(llm)
        got = [llm.generate(ps[0], params[0], use_tqdm=False)[0].outputs[0].token_ids]
        got += [o.outputs[0].token_ids for o in llm.generate(ps[1:], params[1:], use_tqdm=False)]
        assert got == ref
        assert (ingests[0] > 10) == (chain and method == "draft_model")
        drafts[chain] = record
    lengths = [len(d) for d in drafts[True]]
    assert sum(lengths) > 40
    # budgets near max_tokens cut 18 chains short; a threshold cuts more
    assert sum(n < 4 for n in lengths) == 18 if not threshold else sum(n < 4 for n in lengths) > 30
    assert drafts[True] == drafts[False]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_head_layers_match_the_pytorch_path(method, tmp_path, llama_dir):
    """EAGLE's layer (no input norm), EAGLE-3's (a 2H-wide attention input built outside the
    kernel) and the MTP block: a draft step through the kernel equals the PyTorch path."""
    from specserve.methods import load_head
    from tests.methods.test_heads import eagle3_ckpt, eagle_ckpt, mtp_target
    make = {"eagle": eagle_ckpt, "eagle3": eagle3_ckpt, "mtp": mtp_target}[method]
    path = make(tmp_path / method)
    target = use_decode_linears(load_model(path if method == "mtp" else llama_dir,
                                           torch.float32, torch.device("cpu")))
    head = load_head(method, str(path), target, torch.device("cpu"), torch.float32)
    layer = head.block if method == "mtp" else head.layers[0]
    assert layer.cpu_layer is not None
    g = torch.Generator().manual_seed(3)
    width = head.fc.in_features if method == "eagle3" else target.args.hidden_size
    feats = torch.randn(9, width, generator=g)
    ids = torch.randint(0, 96, (9,), generator=g)
    outs = []
    for kernel in (True, False):
        if not kernel:
            layer.cpu_layer = None
        a = head.args
        cache = KVCache(1, 2, a.num_key_value_heads, 32, a.head_dim, torch.float32,
                        torch.device("cpu"))
        with torch.inference_mode():
            h = head.fuse_target(feats)
            md, pos = build_metadata([0], [6], [1], torch.device("cpu"))      # prompt pairs
            head(ids[:6], h[:6], pos, md, cache.layers[0])
            md, pos = build_metadata([6], [3], [1], torch.device("cpu"))      # a draft step
            outs.append(head.draft_logits(head(ids[6:], h[6:], pos, md, cache.layers[0])))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_bfloat16_valued_weights_stream_as_bfloat16_with_the_same_results(llama_dir):
    """A checkpoint stored in bfloat16 (like the bundled zoo) loaded in float32: the kernel
    packs its weights in bfloat16, which changes no product."""
    ids = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    outs = []
    for kernel in (True, False):
        model = load_model(llama_dir, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        use_decode_linears(model)
        a = model.args
        cache = KVCache(a.num_hidden_layers, 2, a.num_key_value_heads, 32, a.head_dim,
                        torch.float32, torch.device("cpu"))
        if kernel:
            layer = model.layers[0]
            assert layer.mlp.down_proj.kernel_weight.dtype == torch.bfloat16
            assert layer.cpu_layer.shape.mode == 1
            assert model.lm_head.kernel_weight.dtype == torch.bfloat16
        else:
            model.cpu_forward = None
            for layer in model.layers:
                layer.cpu_layer = None
        _step(model, cache, [ids[:10]], [0], [1])
        with torch.inference_mode():
            outs.append(model.compute_logits(_step(model, cache, [ids[10:]], [10], [1])))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_bfloat16_models_take_bfloat16_matmul_inputs_and_stay_lossless(llama_dir, draft_dir,
                                                                        tmp_path):
    """dtype bfloat16 on the CPU: the target, a draft model and heads run in the kernel with
    bfloat16 weights and matmul inputs (float32 otherwise); greedy output with speculation
    equals output without, alone and beside sampled requests, and the logits stay close to
    float32's."""
    from specserve import LLM, SamplingParams, TokensPrompt
    from tests.methods.test_heads import eagle3_ckpt, eagle_ckpt
    g = torch.Generator().manual_seed(6)
    ps = [TokensPrompt(prompt_token_ids=torch.randint(0, 96, (n,), generator=g).tolist())
          for n in (4, 11, 25, 7, 30, 16)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.8, seed=1, max_tokens=10)] * 3
    base = LLM(str(llama_dir), device="cpu", dtype="bfloat16")
    ref = [o.outputs[0].token_ids for o in base.generate(ps, greedy, use_tqdm=False)]
    model = base.engine.model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(layer.cpu_layer.shape.mode == 2 for layer in model.layers)
    assert model.lm_head.kernel_weight.dim() == 5
    specs = [{"method": "draft_model", "model": str(draft_dir)},
             {"method": "eagle3", "model": str(eagle3_ckpt(tmp_path / "e3"))},
             {"method": "eagle", "model": str(eagle_ckpt(tmp_path / "e1"))}]
    for spec in specs:
        llm = LLM(str(llama_dir), device="cpu", dtype="bfloat16",
                  speculative_config=spec | {"num_speculative_tokens": 3})
        drafter = getattr(llm.engine.proposer, "model", None) or llm.engine.proposer.head
        assert all(layer.cpu_layer.shape.mode == 2 for layer in drafter.layers), spec
        alone = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids
                 for p in ps[:2]]
        mixed = llm.generate(ps, params, use_tqdm=False)
        assert alone == ref[:2], spec
        assert [o.outputs[0].token_ids for o in mixed[::2]] == ref[::2], spec
        assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    ids = ps[2]["prompt_token_ids"]
    f32 = use_decode_linears(load_model(llama_dir, torch.float32, torch.device("cpu")))
    logits = []
    for m in (model, f32):
        a = m.args
        cache = KVCache(a.num_hidden_layers, 1, a.num_key_value_heads, 32, a.head_dim,
                        torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            logits.append(m.compute_logits(_step(m, cache, [ids], [0], [0])))
    torch.testing.assert_close(logits[0], logits[1], atol=0.05, rtol=0.05)


def test_the_head_chain_checks_its_positions_on_the_c_side(tmp_path, llama_dir, monkeypatch):
    """With the Python bounds check out of the way, the C side still refuses a draft past the
    KV cache (rc -2, a ValueError) instead of writing outside it."""
    from specserve import LLM
    from specserve.kernels.cpu import HeadChain
    from tests.methods.test_heads import eagle3_ckpt
    llm = LLM(str(llama_dir), device="cpu", speculative_config={
        "model": str(eagle3_ckpt(tmp_path / "e3")), "num_speculative_tokens": 3})
    chain = llm.engine.proposer.chain
    state = torch.zeros(1, chain.shape.hidden)
    assert len(chain(state, [5], [0], [3])[0]) == 3                 # in range: drafts
    monkeypatch.setattr(HeadChain, "_check_end", lambda *a: None)
    with pytest.raises(ValueError, match="C side refused"):
        chain(state, [chain.shape.max_len], [0], [3])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normed", [True, False], ids=["k-norm", "no-norm"])
def test_the_kv_writer_writes_what_each_layers_own_projection_would(kv_dtype, normed):
    """KVWriter (DFlash's context in one call) writes, for every layer, the normed and rotated
    keys and the values that layer's `project_kv` gives for the same rows, at their slots and
    positions, and nothing else; a position past the cache is refused on the C side."""
    from specserve.kernels.cpu import KVWriter
    from specserve.models.layers import Attention, Rotary
    g = torch.Generator().manual_seed(0)
    L, H, NKV, D, S, max_len = 3, 48, 2, 16, 3, 20
    attns = [Attention(H, 4, NKV, D, bias=False, qk_norm=normed, eps=1e-5) for _ in range(L)]
    for at in attns:
        for p in at.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.3 + (1 if p.dim() == 1 else 0)
    rot = Rotary(D, max_len, 10000.0, None)
    x = torch.randn(5, H, generator=g)                                        # [T, H]
    slots, pos = torch.tensor([2, 2, 0, 1, 2]), torch.tensor([4, 5, 0, 19, 11])
    kv = torch.cat([at.qkv_proj(x)[:, at.q_size:] for at in attns], 1)      # [T, L * 2 * NKV * D]
    norms = torch.stack([at.k_norm.weight for at in attns]) if normed else None
    cache = KVCache(L, S, NKV, max_len, D, kv_dtype, torch.device("cpu"))
    KVWriter(load_library(), cache.layers, norms, 1e-5, rot.cos_sin)(kv, slots, pos)
    written = torch.zeros(S, max_len, dtype=torch.bool)
    written[slots, pos] = True
    for at, (kc, vc) in zip(attns, cache.layers):
        k, v = at.project_kv(x, rot.tables(pos, x.dtype))                     # [T, NKV, D]
        torch.testing.assert_close(kc[slots, :, pos].float(), k.to(kv_dtype).float())
        torch.testing.assert_close(vc[slots, :, pos].float(), v.to(kv_dtype).float())
        assert not kc.transpose(1, 2)[~written].any() and not vc.transpose(1, 2)[~written].any()
    with pytest.raises(ValueError, match="C side refused"):
        KVWriter(load_library(), cache.layers, norms, 1e-5, rot.cos_sin)(
            kv[:1], slots[:1], torch.tensor([max_len]))


def test_a_draft_models_pass_and_chains_in_one_call_draft_from_the_rows_asked(tmp_path,
                                                                               llama_dir):
    """LlamaChain.after_ingest: the pass over the new rows, then each drafting row's greedy
    token (and chain) from the pass row named, wherever it lies in the pass (PARD drafts from
    several rows of one request): equal to a dense PyTorch pass over the same tokens."""
    from specserve import LLM
    from tests.conftest import make_hf_model
    make_hf_model("llama", tmp_path / "draft", seed=3, hidden_size=32, num_hidden_layers=2,
                  intermediate_size=64)
    llm = LLM(str(llama_dir), device="cpu", speculative_config={
        "method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2})
    chain = llm.engine.proposer.chain
    dense = load_model(tmp_path / "draft", torch.float32, torch.device("cpu"))

    def greedy(ids: list[int]) -> list[int]:                     # each position's argmax
        with torch.inference_mode():
            h = dense(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
            return dense.compute_logits(h).argmax(-1).tolist()

    ids = [5, 17, 3, 9, 40, 2, 11]
    drafts = chain.after_ingest(ids, [0] * 7, list(range(7)), [2, 4, 6], [8, 8, 7], [0, 0, 0],
                                [1, 1, 2])
    want = greedy(ids)
    assert drafts == [[want[2]], [want[4]], [want[6], greedy(ids + [want[6]])[-1]]]
    # the C side moves the drafting rows to the front in place: it refuses rows that fall
    with pytest.raises(ValueError, match="C side refused"):
        chain.after_ingest(ids, [0] * 7, list(range(7)), [4, 2], [8, 8], [0, 0], [1, 1])


# The int8 screen of a vocabulary projection's greedy rows (GreedyScreen,
# DecodeLinear.greedy_logits): exact logits wherever a row's largest may be.
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "pairs"])
def test_screen_gives_the_full_products_argmax_and_exact_candidates(kind, threads, rows):
    """Every packing the screen reads (float32, bfloat16 weights, bfloat16 pairs with inputs
    rounded), an odd input width, exact ties (the first column wins, as in torch.argmax),
    rows of different scales; the finite entries are the full product's bits, on one thread
    and on several (each lists its own share of the columns), with the candidates' columns
    read from the packed weight or from a row-major copy (a tied embedding)."""
    lib, g = load_library(), torch.Generator().manual_seed(0)
    out, inp = 20000, 300
    w = torch.randn(out, inp, generator=g) * 0.05
    if kind == "float32":
        w += 1e-9 * torch.randn(out, inp, generator=g)          # not bfloat16-exact
    else:
        w = w.to(torch.bfloat16).float()
    w[901] = w[out - 5] = w[17]         # columns tie exactly, at both ends (each thread's list)
    packed = pack_weight(w, lib.specserve_block(), pairs=kind == "pairs")
    screen = GreedyScreen(lib, w, packed, rows=w if rows else None)
    x = torch.randn(7, inp, generator=g) * torch.tensor([1, 10, 0.1, 1, 1, 3, 1])[:, None]
    x[3] = 30 * w[17]                                # its largest: 17, 901 and out - 5
    full = linear_rows(lib, x, packed, None, out)
    with torch_threads(threads):
        y = screen(x)
    assert torch.equal(y.argmax(1), full.argmax(1))
    assert y.argmax(1)[3] == 17 and y[3, out - 5] == y[3, 17]
    finite = torch.isfinite(y)
    assert torch.equal(y[finite], full[finite])
    assert (screen.candidates < 200).all()                      # it did screen
    assert (finite.sum(1) == screen.candidates).all()


def test_screen_computes_a_row_whole_where_it_cannot_narrow_it():
    """A zero row (every logit ties) and a NaN row take the whole product (together, in one);
    the others still screen."""
    lib, g = load_library(), torch.Generator().manual_seed(1)
    w = (torch.randn(18000, 256, generator=g) * 0.05).to(torch.bfloat16).float()
    packed = pack_weight(w, lib.specserve_block())
    screen = GreedyScreen(lib, w, packed)
    x = torch.randn(4, 256, generator=g)
    x[0] = 0
    x[2, 5] = float("nan")
    full = linear_rows(lib, x, packed, None, 18000)
    y = screen(x)
    assert screen.candidates[[0, 2]].tolist() == [18000, 18000]
    assert (screen.candidates[[1, 3]] < 200).all()
    assert torch.equal(y[0], full[0]) and torch.equal(y[2].isnan(), full[2].isnan())
    assert torch.equal(y[2][~y[2].isnan()], full[2][~full[2].isnan()])
    finite = torch.isfinite(y[[1, 3]])
    assert torch.equal(y[[1, 3]][finite], full[[1, 3]][finite])
    assert torch.equal(y.argmax(1), full.argmax(1))


def test_smollm2_greedy_output_is_the_same_with_and_without_the_screen(smollm2, monkeypatch):
    """SmolLM2 (float32, as its GGUF loads: its lm_head screened on every CPU, AMX or not)
    decodes the same tokens as with the full product, plain and with EAGLE-3 drafts; a
    request with logprobs gets the full logits."""
    prompts = ["Explain how a bicycle works.", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 2}
    outs = {}
    for screened in (True, False):
        if not screened:
            monkeypatch.setattr(cpu_backend, "SCREEN_MIN_VOCAB", 10**9)
        for s in (None, spec):
            llm = LLM(str(smollm2), speculative_config=s)
            model = llm.engine.model
            assert (model.lm_head.screen is not None) == screened
            if screened:                   # tied: candidates are read from the embedding
                assert model.lm_head.screen.rows is model.embed_tokens.weight
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
