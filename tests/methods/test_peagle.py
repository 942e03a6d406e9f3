"""P-EAGLE (`eagle3` + `parallel_drafting`): an EAGLE-3 head with a learned mask state drafts K
tokens in one pass. Lossless alone and batched, its mask rows' KV never read as context, the
training layout equal to what inference sees, and its loading errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve import LLM, TokensPrompt
from specserve.kernels.cpu.binding import max_rows
from specserve.methods import eagle3
from specserve.models.loader import load_model
from tests.conftest import DEVICE
from tests.test_spec_decode import (
    N_SAMPLES,
    TV_BOUND,
    _exact_pair_distribution,
    _greedy,
    _token_hist,
    assert_lossless_alone_and_mixed,
    repetitive_prompts,
    small_vocab_pair,  # noqa: F401  (a fixture)
)


def make_peagle(target_dir: Path, out: Path, mask: int = 93, seed: int = 0) -> Path:
    """A random P-EAGLE head for the target in `target_dir`, in the speculators format."""
    torch.manual_seed(seed)
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    counts = np.ones(target.args.vocab_size, dtype=np.int64)
    counts[mask] = 0
    head = eagle3.new_head(target, 4, None, counts, parallel=True)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if (p.dim() >= 2 and not name.startswith("embed_tokens")) or name == "mask_hidden":
                p.normal_(0, 0.15)
    eagle3.write(head, out, target_dir, torch.float32)
    return out


@pytest.fixture(scope="module")
def peagle_dir(llama_dir, tmp_path_factory):
    return make_peagle(llama_dir, tmp_path_factory.mktemp("peagle") / "h")


def _spec(path, k: int, **kw) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k,
            "parallel_drafting": True} | kw


@pytest.mark.parametrize("k", [2, 4, 8])
def test_greedy_output_is_the_targets_alone_and_in_mixed_batches(llama_dir, peagle_dir, k):
    assert_lossless_alone_and_mixed(llama_dir, _spec(peagle_dir, k))


def _dense_drafts(head, target, ids: list[int], k: int) -> list[int]:
    """Drafts of one causal pass without a cache: the pairs (target aux state at t, token t+1)
    of the whole context, then k-1 mask rows."""
    q = len(ids) - 1                       # pairs at head positions 0..q-1
    with torch.inference_mode():
        x = torch.tensor([ids])
        _, aux = target(x[:, :q], torch.arange(q)[None], aux_layers=head.aux_layers)
        h = torch.cat([head.fuse_target(aux[0]), head.mask_state().expand(k - 1, -1)])
        toks = torch.tensor([ids[1:] + [head.mask_token_id] * (k - 1)])
        out = head(toks, h[None], torch.arange(q + k - 1)[None], None, None)[0]
        return head.logits(out[q - 1:]).argmax(-1).tolist()


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_one_pass_per_step_and_the_masks_kv_is_never_context(llama_dir, peagle_dir,
                                                            cpu_kernel):
    """Every proposal (pairs ingested step by step into the head's cache, masks on top)
    equals the dense causal pass over the whole context: had a step's mask KV been kept as
    context, later drafts would differ. On the CPU kernel the pass is one C call (the chain's
    ingest, a one-draft chain from each picked row); without it, the PyTorch head."""
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(peagle_dir, 4),
              cpu_kernel=cpu_kernel)
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    head = eagle3.read(peagle_dir, target)
    proposer = llm.engine.proposer
    assert (proposer.chain is not None) == (cpu_kernel and DEVICE == "cpu")
    passes, checked = [], [0]                              # passes: (which, rows)
    run = proposer._run
    proposer._run = lambda *a, **kw: passes.append(("pytorch", len(a[2]))) or run(*a, **kw)
    if proposer.chain is not None:
        ingest = proposer.chain.after_ingest
        proposer.chain.after_ingest = (
            lambda *a, **kw: passes.append(("C", len(a[0]))) or ingest(*a, **kw))
    propose = proposer.propose
    # the C pass takes every pass within the kernel's row limit (512 rows with AVX-512, 48
    # with AVX2), PyTorch the longer ones
    limit = max_rows(proposer.chain.lib) if proposer.chain is not None else 0

    def checked_propose(batch):
        n = len(passes)
        out = propose(batch)
        assert len(passes) == n + 1                        # ingest and all K drafts: one pass
        if batch.requests:                                 # a drafting pass, where expected
            which, rows = passes[-1]
            assert which == ("C" if rows <= limit else "pytorch")
        for r, p, k in zip(batch.requests, out, batch.max_num_tokens):
            assert p.token_ids == _dense_drafts(head, target, list(r.all_token_ids), k)
            checked[0] += 1
        return out

    proposer.propose = checked_propose
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(3, seed=6)]
    llm.generate(ps, _greedy(24), use_tqdm=False)
    assert checked[0] > 10
    assert any(w == "C" for w, _ in passes) == (proposer.chain is not None)


def test_the_training_layout_is_what_inference_sees(llama_dir, peagle_dir):
    """Row t of mask copy c in the training pass equals mask row c of a dense pass over the
    pairs up to t - c (what drafting after position t - c computes)."""
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    head = eagle3.read(peagle_dir, target)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 90, (1, 14), generator=g)
    pos = torch.arange(14)[None]
    K = 4
    with torch.no_grad():
        _, aux = target(x, pos, aux_layers=head.aux_layers)
        rows = eagle3.parallel_drafts(head, x, aux, pos, K)[0]              # [K, L, H]
        for c in range(K):
            for t in range(c, 13):
                ids = x[0, :t - c + 2].tolist()             # pairs 0..t-c, then c masks
                want = _dense_drafts(head, target, ids, c + 1)[-1]
                assert head.logits(rows[c, t]).argmax().item() == want


def test_depth_weights_count_each_copy_as_asked(llama_dir, peagle_dir):
    """A P-EAGLE head trained with depth_gamma weighs copy c's KL by exp(-c / depth_gamma):
    without it the copies count alike; with a tiny gamma only the first; with 2 they mix in
    that proportion."""
    import math

    from specserve.train.heads import head_loss
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    head = eagle3.read(peagle_dir, target)
    fn = head_loss("eagle3", head, target, 2)
    xy = torch.randint(3, 90, (2, 17), generator=torch.Generator().manual_seed(0))
    totals = {}
    for gamma in (None, 1e-6, 2.0):
        head.depth_gamma = gamma
        with torch.no_grad():
            totals[gamma], values = fn(xy)
    kl0, kl1 = values["kl"], values["kl_last"]
    assert abs(kl1 - kl0) > 1e-3                  # the copies differ: the weights matter
    assert float(totals[None]) == pytest.approx((kl0 + kl1) / 2, rel=1e-5)
    assert float(totals[1e-6]) == pytest.approx(kl0, rel=1e-5)
    w = math.exp(-1 / 2.0)
    assert float(totals[2.0]) == pytest.approx((kl0 + w * kl1) / (1 + w), rel=1e-5)


def test_a_chain_weight_adds_the_unrolled_chains_loss(llama_dir, peagle_dir):
    """With chain_weight w a P-EAGLE head's loss is its one-pass loss plus w times the loss the
    same head has unrolled as EAGLE-3's chain (the chain's own loss, mask state aside)."""
    from specserve.train.heads import head_loss
    target = load_model(llama_dir, torch.float32, torch.device("cpu"))
    head = eagle3.read(peagle_dir, target)
    fn = head_loss("eagle3", head, target, 3)
    xy = torch.randint(3, 90, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        one_pass, _ = fn(xy)
        head.chain_weight = 0.5
        both, values = fn(xy)
        head.chain_weight, mask = 0.0, head.mask_hidden
        head.mask_hidden = None                             # the same weights, as a chain
        chain, chain_values = fn(xy)
        head.mask_hidden = mask
    assert values["kl_chain_last"] == pytest.approx(chain_values["kl_step3"], rel=1e-5)
    assert float(both) == pytest.approx(float(one_pass) + 0.5 * float(chain), rel=1e-5)
    with pytest.raises(ValueError, match="chain_weight is for a P-EAGLE head"):
        eagle3.new_head(target, 2, chain_weight=1.0)


def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path):  # noqa: F811
    target, _ = small_vocab_pair
    head = make_peagle(target, tmp_path / "pe", mask=6, seed=1)
    llm = LLM(str(target), device=DEVICE, max_num_seqs=64, max_num_batched_tokens=512,
              speculative_config=_spec(head, 2))
    exact = _exact_pair_distribution(target)
    tv = 0.5 * (_token_hist(llm, N_SAMPLES, 400_000) - exact).abs().sum().item()
    assert 0.02 < llm.get_stats()["acceptance_rate"] < 0.95
    assert tv < TV_BOUND, f"total variation {tv:.3f} from the target's exact distribution"


def test_a_chain_head_a_tree_and_a_missing_mask_token_are_refused(llama_dir, peagle_dir,
                                                                  tmp_path):
    from tests.methods.test_heads import eagle3_ckpt
    chain = eagle3_ckpt(tmp_path / "e3")
    with pytest.raises(ValueError, match="not trained for it.*train eagle3 --parallel"):
        LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(chain, 4))
    with pytest.raises(ValueError, match="drop speculative_token_tree"):
        LLM(str(llama_dir), device=DEVICE, speculative_config={
            "model": str(peagle_dir), "parallel_drafting": True,
            "speculative_token_tree": "[(0,), (1,)]"})
    bad = tmp_path / "bad"
    shutil.copytree(peagle_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["mask_token_id"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="names no mask token"):
        LLM(str(llama_dir), device=DEVICE, speculative_config=_spec(bad, 4))
    # the same head drafts as a chain without the flag
    LLM(str(llama_dir), device=DEVICE, speculative_config={
        "model": str(peagle_dir), "num_speculative_tokens": 3})
