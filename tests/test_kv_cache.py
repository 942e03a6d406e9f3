"""KVCache: slots allocated and freed, positions moved in every layer."""

import pytest
import torch

from specserve.kv_cache import KVCache
from specserve.models.cpu_backend import KernelLayer


def test_slots_are_allocated_once_and_freed_back():
    c = KVCache(2, 3, 1, 8, 4, torch.float32, torch.device("cpu"))
    slots = [c.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and c.num_free_slots == 0
    with pytest.raises(AssertionError, match="no free KV slot"):
        c.allocate()
    c.free(slots[1])
    assert c.num_free_slots == 1 and c.allocate() == slots[1]
    with pytest.raises(AssertionError):
        c.free(7)                                    # not a slot


def test_move_copies_positions_of_one_slot_in_every_layer():
    c = KVCache(2, 2, 1, 8, 4, torch.float32, torch.device("cpu"))
    for li, (k, v) in enumerate(c.layers):
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).view_as(k) + 1000 * li)
        v.copy_(-k)
    before = [(k.clone(), v.clone()) for k, v in c.layers]
    c.move(1, [5, 6], [2, 3])
    for (k, v), (k0, v0) in zip(c.layers, before):
        assert torch.equal(k[1, :, 2:4], k0[1, :, 5:7]) and torch.equal(v[1, :, 2:4], v0[1, :, 5:7])
        assert torch.equal(k[0], k0[0])              # the other slot is untouched
        assert torch.equal(k[1, :, 4:], k0[1, :, 4:])
    assert c.nbytes() == 2 * 2 * 2 * 8 * 4 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_holds_memory_only_for_the_positions_written(dtype):
    """A long-context cache costs what its requests wrote: a few keys in every slot of every
    layer (a batch of short chats) must not make whole slots resident, as NumPy's zeroed
    arrays did by asking for transparent huge pages (2 MiB held per first write)."""
    from specserve.bench.probes import resident_bytes
    if resident_bytes() is None:
        pytest.skip("no /proc/self/status to read resident memory from")
    c = KVCache(8, 8, 3, 8192, 64, dtype, torch.device("cpu"))      # 200-400 MB if all touched
    before = resident_bytes()
    for k, v in c.layers:
        k[:, :, :3] = 1.0       # three positions per slot and head: 9 pages of 4 KiB per tensor
        v[:, :, :3] = 1.0
    grown = resident_bytes() - before
    assert c.nbytes() > 200e6 and grown < 8e6, f"{grown / 1e6:.0f} MB resident after 3 positions"
    assert float(c.layers[0][0][0, 0, 3:].abs().sum()) == 0.0       # unwritten positions read 0


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_a_bfloat16_kv_cache_takes_half_the_memory_and_speculation_stays_lossless(
        cpu_kernel, llama_dir, draft_dir, tmp_path):
    """kv_cache_dtype="bfloat16": the target's cache holds bfloat16 (half the bytes), the
    kernel and the PyTorch path read it alike (greedy tokens equal), and greedy output with
    each drafter equals the same engine's without speculation, beside sampled requests."""
    from specserve import LLM, SamplingParams, TokensPrompt
    from tests.methods.test_heads import eagle3_ckpt
    g = torch.Generator().manual_seed(5)
    ps = [TokensPrompt(prompt_token_ids=torch.randint(3, 96, (n,), generator=g).tolist())
          for n in (4, 19, 33, 8, 27, 12)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref_llm = LLM(str(llama_dir), device="cpu", kv_cache_dtype="bfloat16")
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(ps, greedy, use_tqdm=False)]
    f32 = LLM(str(llama_dir), device="cpu")
    assert ref_llm.engine.cache.layers[0][0].dtype == torch.bfloat16
    assert 2 * ref_llm.engine.cache.nbytes() == f32.engine.cache.nbytes()
    params = [greedy, SamplingParams(temperature=0.8, seed=1, max_tokens=10)] * 3
    for spec in (None, {"method": "ngram", "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": str(draft_dir)},
                 {"method": "eagle3", "model": str(eagle3_ckpt(tmp_path / "e3"))}):
        llm = LLM(str(llama_dir), device="cpu", kv_cache_dtype="bfloat16", cpu_kernel=cpu_kernel,
                  speculative_config=spec and spec | {"num_speculative_tokens": 3})
        assert isinstance(llm.engine.model.layers[0], KernelLayer) == cpu_kernel
        out = llm.generate(ps, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out[::2]] == ref[::2], spec
        if spec is not None:
            assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0


def test_kv_cache_dtypes_it_cannot_hold_are_refused(llama_dir):
    from specserve import LLM
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported; use one of "
                                         "auto, float32, bfloat16"):
        LLM(str(llama_dir), device="cpu", kv_cache_dtype="fp8")


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_auto_keeps_the_kv_cache_in_the_models_dtype(cpu_kernel, llama_dir):
    """"auto" is the dtype the model was loaded in (vLLM's rule), also where the CPU kernel
    computes a bfloat16 model in float32; an explicit dtype overrides it either way."""
    from specserve import LLM
    for dtype, kv, held in (("bfloat16", "auto", torch.bfloat16),
                            ("float32", "auto", torch.float32),
                            ("bfloat16", "float32", torch.float32),
                            ("float32", "bfloat16", torch.bfloat16)):
        llm = LLM(str(llama_dir), device="cpu", dtype=dtype, kv_cache_dtype=kv,
                  cpu_kernel=cpu_kernel)
        assert llm.engine.cache.layers[0][0].dtype == held, (dtype, kv)
