"""Logits of every supported architecture equal transformers' (prefill, decode, ragged, verify)."""

from __future__ import annotations

import torch

from specserve.kv_cache import KVCache
from specserve.models.cpu_backend import use_decode_linears
from specserve.models.loader import load_model
from specserve.models.metadata import build_metadata
from tests.conftest import DEVICE

TOL = 1e-4


class Stepper:
    """Drive our model with a KV cache the way the runner does."""

    def __init__(self, path, num_slots: int = 4, kind: str = "pytorch"):
        self.model = load_model(path, torch.float32, torch.device("cpu"))
        if kind == "kernel":
            use_decode_linears(self.model)
            assert all(layer.cpu_layer is not None for layer in self.model.layers)
        a = self.model.args
        self.cache = KVCache(a.num_hidden_layers, num_slots, a.num_key_value_heads, 256,
                             a.head_dim, torch.float32, torch.device("cpu"))

    @torch.inference_mode()
    def run(self, feeds: list[list[int]], starts: list[int], slots: list[int]) -> list[torch.Tensor]:
        md, pos = build_metadata(starts, [len(f) for f in feeds], slots, torch.device("cpu"))
        ids = torch.tensor([t for f in feeds for t in f])
        logits = self.model.compute_logits(self.model(ids, pos, md, self.cache.layers))
        return list(logits.split([len(f) for f in feeds]))


def ref_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_matches(hf_model, path_kind):
    _, path, hf = hf_model
    ids = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    out = Stepper(path, kind=path_kind).run([ids], [0], [0])[0]
    assert (out - ref_logits(hf, ids)).abs().max() <= TOL


def test_decode_step_by_step_matches(hf_model, path_kind):
    _, path, hf = hf_model
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = ref_logits(hf, ids)
    s = Stepper(path, kind=path_kind)
    s.run([ids[:10]], [0], [2])
    for i in range(10, 30):
        out = s.run([[ids[i]]], [i], [2])[0]
        assert (out[0] - ref[i]).abs().max() <= TOL, f"position {i}"


def test_ragged_batch_matches(hf_model, path_kind):
    _, path, hf = hf_model
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 33, 1, 18)]
    s = Stepper(path, kind=path_kind)
    # Mixed step: whole prompts for three requests, the fourth only partly (a prompt chunk).
    outs = s.run([seqs[0], seqs[1], seqs[2], seqs[3][:5]], [0, 0, 0, 0], [0, 1, 2, 3])
    for seq, out in zip(seqs[:3], outs):
        assert (out - ref_logits(hf, seq)).abs().max() <= TOL
    # Next step: the rest of request 3 together with one decode token for the others.
    ext = [seq + [5] for seq in seqs[:3]]
    outs = s.run([[5], [5], [5], seqs[3][5:]], [7, 33, 1, 5], [0, 1, 2, 3])
    for seq, out in zip(ext, outs[:3]):
        assert (out[0] - ref_logits(hf, seq)[-1]).abs().max() <= TOL
    assert (outs[3] - ref_logits(hf, seqs[3])[5:]).abs().max() <= TOL


def test_verify_step_after_rollback_matches(hf_model, path_kind):
    _, path, hf = hf_model
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 96, (20,), generator=g).tolist()
    wrong = [1, 2, 3, 4]
    right = [9, 8, 7, 6]
    s = Stepper(path, kind=path_kind)
    s.run([prompt], [0], [1])
    s.run([wrong], [20], [1])                  # drafts that get rejected: KV written at 20..23
    # Roll back by counter: the next step writes again from position 21 (one draft accepted).
    seq = prompt + wrong[:1] + right
    out = s.run([right], [21], [1])[0]          # a (k+1)-token verify step, k = 3
    assert (out - ref_logits(hf, seq)[21:]).abs().max() <= TOL


def test_half_precision_dtypes_track_float32(llama_dir):
    import torch as t
    ids = t.randint(0, 96, (24,), generator=t.Generator().manual_seed(5)).tolist()
    ref = Stepper(llama_dir).run([ids], [0], [0])[0]
    for dtype in (t.bfloat16, t.float16):
        m = load_model(llama_dir, dtype, t.device("cpu"))
        cache = KVCache(2, 1, 2, 64, 16, dtype, t.device("cpu"))
        md, pos = build_metadata([0], [len(ids)], [0], t.device("cpu"))
        with t.inference_mode():
            out = m.compute_logits(m(t.tensor(ids), pos, md, cache.layers)).float()
        assert out.dtype == t.float32 and (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_engine_model_uses_packed_weights_and_matches_transformers(hf_model):
    from specserve import LLM, SamplingParams, TokensPrompt
    from specserve.models.cpu_backend import DecodeLinear
    _, path, hf = hf_model
    llm = LLM(str(path), device=DEVICE)
    if DEVICE == "cpu":
        assert isinstance(llm.engine.model.layers[0].mlp.down_proj, DecodeLinear)
    ids = list(range(3, 23))
    out = llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(
        temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)[0].outputs[0]
    tok = out.token_ids[0]
    ref = torch.log_softmax(ref_logits(hf, ids)[-1], -1)[tok].item()
    assert abs(out.logprobs[0][tok] - ref) < 1e-4


def test_grouped_attention_equals_gqa_attention():
    """The CUDA path's masked GQA (a group's query heads as rows of one head) attends exactly
    as SDPA's enable_gqa does, causal verify rows and padded decode masks alike."""
    import torch.nn.functional as F

    from specserve.models.layers import grouped_attention
    g = torch.Generator().manual_seed(0)
    for H, Hkv, Q in ((8, 2, 1), (8, 2, 5), (6, 3, 3), (4, 4, 2)):
        q = torch.randn(2, Q, H, 16, generator=g)                          # [B, Q, H, D]
        k, v = torch.randn(2, 2, Hkv, 24, 16, generator=g).unbind(0)       # [B, Hkv, L, D]
        pos = torch.tensor([[7 + i for i in range(Q)], [20 - Q + i for i in range(Q)]])
        mask = (torch.arange(24)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [B,1,Q,L]
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                             scale=0.25, enable_gqa=True).transpose(1, 2)
        out = grouped_attention(q, k, v, mask, 0.25)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
