"""Head training: every method's loss and format, init, draft vocabularies, joint training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve import LLM, SamplingParams
from specserve.train.generated import GeneratedData
from specserve.train.trainer import TrainConfig
from tests.conftest import DEVICE
from tests.train.conftest import _assert_same_weights


def test_staged_head_build_skips_finished_stages(small_corpus, tiny_lm, tmp_path):
    """A head stage the checkpoint has already passed reports itself skipped (not unfinished,
    which would stop `zoo build`) and leaves the later stage's head in place."""
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm

    def stage(steps: int) -> dict:
        cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=steps, batch_size=2, seq_len=32,
                          warmup=1, ckpt_every=1, bf16=False, device=DEVICE)
        return train_head("medusa", cfg, target, tmp_path / "medusa", k=2,
                          gen=GeneratedData(num_generated=1, generated_len=8),
                          corpus=small_corpus)

    assert "tau" in stage(3) and "tau" in stage(5)
    written = (tmp_path / "medusa" / "model.safetensors").read_bytes()
    assert "step 5" in stage(3)["skipped"]
    assert (tmp_path / "medusa" / "model.safetensors").read_bytes() == written


def test_refreshed_draft_vocab_keeps_the_rows_of_tokens_both_hold():
    from specserve.train.heads import _remap_vocab
    torch.manual_seed(0)
    target_lm = torch.randn(10, 4)                                   # [V, H]
    old_ids = torch.tensor([1, 3, 5, 7])
    trained = {"lm_head.weight": 3 * target_lm[old_ids] + 0.01, "d2t": old_ids - torch.arange(4),
               "fc.weight": torch.ones(2)}
    new_ids = torch.tensor([0, 3, 7, 8, 9])                          # a larger vocabulary
    out = _remap_vocab(trained, new_ids - torch.arange(5), target_lm)
    assert torch.equal(out["d2t"], new_ids - torch.arange(5))
    assert out["fc.weight"] is trained["fc.weight"]
    lm, old = out["lm_head.weight"], trained["lm_head.weight"]
    assert torch.equal(lm[1], old[1]) and torch.equal(lm[2], old[3])        # tokens 3 and 7
    scale = old[[1, 3]].norm(dim=1).mean() / target_lm[[3, 7]].norm(dim=1).mean()
    for j, t in ((0, 0), (3, 8), (4, 9)):
        torch.testing.assert_close(lm[j], target_lm[t] * scale)


def test_target_logp_over_a_draft_vocabulary_multiplies_only_its_rows(tiny_lm):
    """The distillation target over a draft vocabulary: the lm_head's chosen rows alone (the
    full product is never taken) give the full logits' log-softmax restricted to them."""
    from specserve.models.loader import load_model
    from specserve.train.heads import _target_logp
    target = load_model(tiny_lm[0], torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    h = torch.randn(2, 5, target.lm_head.in_features)                          # [B, S, H]
    ids = torch.randperm(target.lm_head.out_features)[:37]
    with torch.no_grad():
        full = target.compute_logits(h)                                         # [B, S, vocab]
        target.compute_logits = None                            # the full product, not called
        torch.testing.assert_close(_target_logp(target, h, ids),
                                   torch.log_softmax(full[..., ids], -1))
        del target.compute_logits
        torch.testing.assert_close(_target_logp(target, h), torch.log_softmax(full, -1))


@pytest.mark.parametrize("method, draft_vocab, top1", [
    ("medusa", None, 0), ("mlp_speculator", None, 0), ("eagle", None, 0), ("eagle3", None, 0),
    ("eagle3", 100, 1.0), ("mtp", None, 0), ("dflash", None, 0)])
def test_head_training_smoke(method, draft_vocab, top1, tiny_lm, small_corpus, tmp_path):
    """Seconds of training lower the loss, write the public format, and the head loads and
    speculates losslessly with a measured tau."""
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=25, batch_size=4, seq_len=64, lr=3e-3,
                      warmup=2, eval_every=25, bf16=False, device=DEVICE, top1_weight=top1)
    result = train_head(method, cfg, target, tmp_path / f"tiny-{method}", k=3,
                        gen=GeneratedData(num_generated=2, generated_len=16),
                        corpus=small_corpus, draft_vocab=draft_vocab)
    if draft_vocab:
        d2t = load_file(str(tmp_path / f"tiny-{method}" / "model.safetensors"))["d2t"]
        ids = torch.arange(draft_vocab) + d2t
        assert len(set(ids.tolist())) == draft_vocab and ids.max() < 400 and d2t.any()
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in log[-3:]) < sum(r["loss"] for r in log[:3])
    assert 1.0 <= result["tau"] <= 4.0 and len(result["per_position"]) == 3
    spec = {"method": method, "num_speculative_tokens": 3}
    if method != "mtp":
        spec["model"] = str(tmp_path / f"tiny-{method}")
    model = tmp_path / f"tiny-{method}" if method == "mtp" else target
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(target), device=DEVICE).generate("def f(x):", sp, use_tqdm=False)
    got = LLM(str(model), device=DEVICE, speculative_config=spec).generate("def f(x):", sp,
                                                                          use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    if method == "mtp":     # the target's weights are linked, not copied
        shards = [f for f in model.iterdir() if f.suffix == ".safetensors"]
        assert [f.name for f in shards if not f.is_symlink()] == ["model-mtp.safetensors"]


def test_train_dflash_takes_its_block_size_and_layers(tiny_lm, small_corpus, tmp_path):
    from specserve.cli import main
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=3, batch_size=2, seq_len=32,
                      warmup=1, bf16=False, device=DEVICE)
    result = train_head("dflash", cfg, target, tmp_path / "d", k=3,
                        gen=GeneratedData(num_generated=1, generated_len=8), corpus=small_corpus,
                        head_options={"block_size": 4, "num_layers": 1})
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (written["block_size"], written["num_hidden_layers"]) == (4, 1)
    assert len(result["per_position"]) == 3
    quality = json.loads((tmp_path / "d" / "quality.json").read_text())
    assert quality["k"] == 3 and quality["tau"] == result["tau"]
    with pytest.raises(ValueError, match="a block of 4 drafts at most 3 tokens, not K=5"):
        train_head("dflash", cfg, target, tmp_path / "e", k=5, corpus=small_corpus,
                   head_options={"block_size": 4})
    with pytest.raises(SystemExit, match="--block-size and --layers are for dflash"):
        main(["train", "eagle3", "--target", str(target), "--out", str(tmp_path / "x"),
              "--block-size", "4"])


def test_train_a_peagle_head_from_a_chain_head(tiny_lm, small_corpus, tmp_path):
    """--parallel --init CHAIN: the chain head's weights carry over, the mask state is new,
    the loss (one pass and, with a chain weight, the chain) falls, and the result drafts with
    parallel_drafting losslessly."""
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm
    gen = GeneratedData(num_generated=2, generated_len=16)

    def cfg(work: str, steps: int) -> TrainConfig:
        return TrainConfig(work_dir=str(tmp_path / work), steps=steps, batch_size=4, seq_len=48,
                           lr=3e-3, warmup=2, eval_every=steps, bf16=False, device=DEVICE)

    train_head("eagle3", cfg("chain", 4), target, tmp_path / "chain", k=3, gen=gen,
               corpus=small_corpus)
    result = train_head("eagle3", cfg("parallel", 20), target, tmp_path / "pe", k=4, gen=gen,
                        corpus=small_corpus, init=tmp_path / "chain",
                        head_options={"parallel": True, "chain_weight": 0.5})
    written = load_file(str(tmp_path / "pe" / "model.safetensors"))
    chain = load_file(str(tmp_path / "chain" / "model.safetensors"))
    assert written["mask_hidden"].shape == (1, chain["fc.weight"].shape[1])
    assert json.loads((tmp_path / "pe" / "config.json").read_text())["mask_token_id"] >= 3
    log = [json.loads(x)
           for x in (tmp_path / "parallel" / "train_log.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in log[-3:]) < sum(r["loss"] for r in log[:3])
    assert "kl_chain_last" in log[-1]
    assert 1.0 <= result["tau"] <= 5.0 and len(result["per_position"]) == 4
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(str(target), device=DEVICE).generate("def f(x):", sp, use_tqdm=False)
    got = LLM(str(target), device=DEVICE, speculative_config={
        "model": str(tmp_path / "pe"), "num_speculative_tokens": 4, "parallel_drafting": True,
    }).generate("def f(x):", sp, use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    # and back: a chain run from the P-EAGLE head (zero learning rate) keeps all but the mask
    again = TrainConfig(work_dir=str(tmp_path / "again"), steps=1, batch_size=2, seq_len=32,
                        lr=0.0, warmup=1, bf16=False, device=DEVICE)
    train_head("eagle3", again, target, tmp_path / "chain2", k=4, gen=gen, corpus=small_corpus,
               init=tmp_path / "pe")
    chain2 = load_file(str(tmp_path / "chain2" / "model.safetensors"))
    assert chain2.keys() == written.keys() - {"mask_hidden"}
    for name, value in chain2.items():
        torch.testing.assert_close(value, written[name], rtol=0, atol=0)


def test_top1_weight_adds_a_cross_entropy_to_the_targets_top_token():
    """--top1-weight: the loss gains that multiple of the cross-entropy to the target's most
    likely token, and fitting free logits to a flat target with it gives that token a wider
    lead than the KL alone does (the KL's optimum is the target itself)."""
    import torch.nn.functional as F

    from specserve.train.heads import _distill
    torch.manual_seed(0)
    logits, target = torch.randn(2, 5, 50), torch.randn(2, 5, 50)
    logp = F.log_softmax(target, -1)
    ce = F.cross_entropy(logits.flatten(0, 1), target.argmax(-1).flatten())
    torch.testing.assert_close(_distill(logits, logp, 0.5) - _distill(logits, logp), 0.5 * ce)

    flat = F.log_softmax(torch.tensor([[1.0, 0.9, 0.8, 0.0]]), -1)            # top token 0
    leads = []
    for weight in (0.0, 1.0):
        x = torch.zeros(1, 4, requires_grad=True)
        opt = torch.optim.Adam([x], lr=0.1)
        for _ in range(300):
            opt.zero_grad()
            _distill(x, flat, weight).backward()
            opt.step()
        leads.append((x[0, 0] - x[0, 1:].max()).item())
    assert leads[0] == pytest.approx(0.1, abs=0.02) and leads[1] > 3 * leads[0]
    with pytest.raises(ValueError, match="top1_weight must be >= 0"):
        TrainConfig(work_dir="w", top1_weight=-1)


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_head_training_starts_from_init(method, tiny_lm, small_corpus, tmp_path):
    """--init: the run starts from the given head (with a zero learning rate it writes the same
    weights back); a head of another shape is refused with the reason."""
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm
    gen = GeneratedData(num_generated=1, generated_len=8)

    def run(work: str, out: str, lr: float, **kw) -> dict:
        cfg = TrainConfig(work_dir=str(tmp_path / work), steps=4, batch_size=2, seq_len=32,
                          lr=lr, warmup=1, bf16=False, device=DEVICE)
        return train_head(method, cfg, target, tmp_path / out, k=2, gen=gen,
                          corpus=small_corpus, draft_vocab=100 if method == "eagle3" else None,
                          **kw)

    run("w1", "first", 3e-3)
    run("w2", "again", 0.0, init=tmp_path / "first")
    _assert_same_weights(tmp_path / "first", tmp_path / "again")
    with pytest.raises(ValueError, match="does not match"):
        cfg = TrainConfig(work_dir=str(tmp_path / "w3"), steps=1, batch_size=2, seq_len=32,
                          bf16=False, device=DEVICE)
        train_head(method, cfg, target, tmp_path / "x", k=3, gen=gen, corpus=small_corpus,
                   init=tmp_path / "first")


def test_eagle3_unrolled_training_drafts_as_the_chain_does(tiny_lm):
    """The training-time test: pass j at row t equals the KV-cached drafting chain started after
    position t (context ingested with target states, then j drafts fed back), for every t."""
    from specserve.kv_cache import KVCache
    from specserve.methods.eagle3 import unrolled_drafts
    from specserve.models.loader import load_model
    from specserve.models.metadata import ragged_inputs
    from specserve.train.heads import build_head
    target = load_model(tiny_lm[0], torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    head = build_head("eagle3", target, k=3).float()
    for p in head.parameters():             # a fresh head's zero-ish weights would hide errors
        p.data.normal_(0, 0.3)
    S, k, a = 12, 3, head.args
    x = torch.randint(0, target.args.vocab_size, (1, S))
    aux = torch.randn(1, S, 3 * a.hidden_size)
    pos = torch.arange(S)[None]
    with torch.no_grad():
        outs = unrolled_drafts(head, x, aux, pos, k)
        tok = x[0, 1:].tolist()
        for t in range(S - k):
            cache = KVCache(1, 1, a.num_key_value_heads, S, a.head_dim, torch.float32,
                            torch.device("cpu")).layers[0]
            ids, positions, md = ragged_inputs([tok[:t + 1]], [0], [0], torch.device("cpu"))
            out = head(ids, head.fuse_target(aux[0, :t + 1]), positions, md, cache)[-1:]
            torch.testing.assert_close(out[0], outs[0][0, t])
            for j in range(1, k):
                ids, positions, md = ragged_inputs([[tok[t + j]]], [t + j], [0],
                                                   torch.device("cpu"))
                out = head(ids, out, positions, md, cache)
                torch.testing.assert_close(out[0], outs[j][0, t], atol=1e-5, rtol=1e-4)


def test_eagle3_training_from_init_can_refresh_its_draft_vocab(tiny_lm, small_corpus, tmp_path):
    """--refresh-draft-vocab: the head takes this run's most frequent tokens (here a larger
    vocabulary); with a zero learning rate the rows of tokens both vocabularies hold are the
    init head's."""
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm
    gen = GeneratedData(num_generated=1, generated_len=8)

    def run(work: str, out: str, lr: float, vocab: int, **kw) -> dict[str, torch.Tensor]:
        cfg = TrainConfig(work_dir=str(tmp_path / work), steps=3, batch_size=2, seq_len=32,
                          lr=lr, warmup=1, bf16=False, device=DEVICE)
        train_head("eagle3", cfg, target, tmp_path / out, k=2, gen=gen, corpus=small_corpus,
                   draft_vocab=vocab, **kw)
        return load_file(str(tmp_path / out / "model.safetensors"))

    first = run("w1", "first", 3e-3, 100)
    again = run("w2", "again", 0.0, 150, init=tmp_path / "first", refresh_vocab=True)
    old = (torch.arange(100) + first["d2t"]).tolist()
    new = (torch.arange(150) + again["d2t"]).tolist()
    assert set(old) < set(new) and len(set(new)) == 150
    for j, t in enumerate(new):
        if t in old:
            assert torch.equal(again["lm_head.weight"][j], first["lm_head.weight"][old.index(t)])
    assert torch.equal(again["fc.weight"], first["fc.weight"])
    with pytest.raises(ValueError, match="applies to heads with one \\(eagle3\\)"):
        cfg = TrainConfig(work_dir=str(tmp_path / "w3"), steps=1, batch_size=2, seq_len=32,
                          bf16=False, device=DEVICE)
        train_head("medusa", cfg, target, tmp_path / "x", k=2, gen=gen, corpus=small_corpus,
                   init=tmp_path / "first", refresh_vocab=True)


def test_heads_trained_together_share_one_target_pass(tiny_lm, small_corpus, tmp_path):
    """The joint loss is the sum of each head's own loss on the batch; a short joint run lowers
    every head's loss and writes each head in its format, and the heads speculate losslessly."""
    from specserve.models.loader import load_model
    from specserve.train.heads import build_head, head_loss, joint_head_loss, train_heads
    target, _, _ = tiny_lm
    model = load_model(target, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    heads = torch.nn.ModuleDict({m: build_head(m, model, 3) for m in ("medusa", "eagle", "mtp")})
    xy = torch.randint(0, 300, (2, 33))
    joint, values = joint_head_loss(heads, model, 3)(xy)
    alone = [head_loss(m, h, model, 3)(xy)[0] for m, h in heads.items()]
    torch.testing.assert_close(joint, sum(alone))
    weighted = [head_loss(m, h, model, 3, top1_weight=1.0)(xy)[0] for m, h in heads.items()]
    torch.testing.assert_close(joint_head_loss(heads, model, 3, 1.0)(xy)[0], sum(weighted))
    assert all(w > a for w, a in zip(weighted, alone))
    assert {"medusa_loss", "eagle_feature_l1", "mtp_kl"} <= values.keys()

    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=25, batch_size=4, seq_len=64, lr=3e-3,
                      warmup=2, eval_every=25, bf16=False, device=DEVICE)
    outs = {"medusa": tmp_path / "tiny-medusa", "mlp_speculator": tmp_path / "tiny-mlp"}
    results = train_heads(outs, cfg, target, k=3, gen=GeneratedData(num_generated=2,
                          generated_len=16), corpus=small_corpus)
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    for key in ("medusa_loss", "mlp_speculator_loss"):
        assert sum(r[key] for r in log[-3:]) < sum(r[key] for r in log[:3])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(target), device=DEVICE).generate("def f(x):", sp, use_tqdm=False)
    for method, out in outs.items():
        assert 1.0 <= results[method]["tau"] <= 4.0
        got = LLM(str(target), device=DEVICE, speculative_config={
            "method": method, "model": str(out), "num_speculative_tokens": 3}).generate(
            "def f(x):", sp, use_tqdm=False)
        assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="train it alone"):
        train_heads({"eagle3": tmp_path / "a", "eagle": tmp_path / "b"}, cfg, target)


def _extract(target: Path, out: Path) -> list:
    """Serve a few greedy requests with extract_hidden_states writing to `out`."""
    llm = LLM(str(target), device=DEVICE, speculative_config={
        "method": "extract_hidden_states", "hidden_states_dir": str(out)})
    prompts = ["def f(x):", "class A:\n    def", "import os\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert llm.get_stats()["hidden_state_files"] == 3
    return outs


def test_extracted_hidden_states_are_the_targets(tiny_lm, tmp_path):
    from safetensors import safe_open

    from specserve.models.loader import load_model
    from specserve.train.trainer import _positions
    target_dir, _, _ = tiny_lm
    outs = _extract(target_dir, tmp_path / "states")
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    for o in outs:
        path = tmp_path / "states" / f"{o.request_id}.safetensors"
        t = load_file(str(path))
        tokens = o.prompt_token_ids + o.outputs[0].token_ids
        assert t["token_ids"].tolist() == tokens
        assert t["hidden"].shape[0] == len(tokens) - 1      # every position whose KV was computed
        with safe_open(str(path), "pt") as f:
            layers = tuple(json.loads(f.metadata()["layers"]))
        x = torch.tensor([tokens[:-1]])
        with torch.no_grad():
            h, aux = target(x, _positions(x), aux_layers=layers)
        torch.testing.assert_close(t["hidden"], h[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(t["aux_hidden"], aux[0], atol=1e-4, rtol=1e-4)
    assert not list((tmp_path / "states").glob("*.tmp"))          # none left half written


def test_a_head_trained_from_extracted_states_equals_one_trained_from_the_text(tiny_lm,
                                                                              tmp_path):
    """One optimizer step on the files' states and one on the same token windows with the
    target run on them give the same loss and the same head (windows from each request's
    start: a later window's states saw the whole request before it, as when serving)."""
    import copy

    from specserve.models.loader import load_model
    from specserve.train.heads import (
        build_head,
        head_loss,
        read_hidden_states,
        state_batches,
        state_loss,
    )
    target_dir, _, _ = tiny_lm
    _extract(target_dir, tmp_path / "states")
    target = load_model(target_dir, torch.float32, torch.device("cpu")).requires_grad_(False)
    states, layers = read_hidden_states(tmp_path / "states")
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=1, batch_size=3, seq_len=24,
                      bf16=False, device=DEVICE)
    S = cfg.seq_len
    batch = {"xy": torch.stack([d["token_ids"][:S + 1] for d in states]),
             "positions": torch.arange(S).expand(len(states), S),
             "aux_hidden": torch.stack([d["aux_hidden"][:S] for d in states]),
             "hidden": torch.stack([d["hidden"][:S] for d in states])}
    random_batch = state_batches(states, cfg, torch.device("cpu"))(0)
    assert random_batch["xy"].shape == (3, S + 1) and random_batch["positions"][0, 0] >= 0
    heads = {}
    for source in ("files", "text"):
        torch.manual_seed(0)
        head = build_head("eagle3", target, 2)
        head.aux_layers = layers
        fn = (state_loss("eagle3", head, target, 2) if source == "files"
              else head_loss("eagle3", head, target, 2))
        loss, _ = fn(batch if source == "files" else batch["xy"])
        loss.backward()
        with torch.no_grad():
            for p in head.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
        heads[source] = (loss.item(), copy.deepcopy(head.state_dict()))
    assert heads["files"][0] == pytest.approx(heads["text"][0], rel=1e-4)
    for name, value in heads["files"][1].items():
        torch.testing.assert_close(value, heads["text"][1][name], atol=1e-4, rtol=1e-3)


def test_hidden_states_of_several_runs_read_together_and_held_in_bfloat16(tiny_lm, tmp_path):
    """Several chat-data runs train as one set; held in bfloat16 (a large set's memory), the
    states are the files' rounded, and batches still come out in float32."""
    from specserve.train.heads import read_hidden_states, state_batches
    target_dir, _, _ = tiny_lm
    _extract(target_dir, tmp_path / "a")
    _extract(target_dir, tmp_path / "b" / "batch-00000")
    one, layers = read_hidden_states(tmp_path / "a")
    both, layers2 = read_hidden_states([tmp_path / "a", tmp_path / "b"], torch.bfloat16)
    assert len(both) == 2 * len(one) and layers2 == layers
    assert both[0]["token_ids"].dtype == one[0]["token_ids"].dtype
    torch.testing.assert_close(both[0]["aux_hidden"], one[0]["aux_hidden"].to(torch.bfloat16))
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=1, batch_size=3, seq_len=24,
                      device=DEVICE)
    assert state_batches(both, cfg, torch.device("cpu"))(0)["hidden"].dtype == torch.float32
    with pytest.raises(ValueError, match="empty holds no .safetensors files"):
        read_hidden_states([tmp_path / "a", tmp_path / "empty"])


def test_train_eagle3_from_hidden_states(tiny_lm, tmp_path):
    from specserve.train.heads import train_head
    target_dir, _, _ = tiny_lm
    _extract(target_dir, tmp_path / "states")
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=4, batch_size=2, seq_len=24,
                      lr=3e-3, warmup=1, eval_every=4, bf16=False, device=DEVICE)
    _extract(target_dir, tmp_path / "more")
    result = train_head("eagle3", cfg, target_dir, tmp_path / "head", k=2,
                        hidden_states=[tmp_path / "states", tmp_path / "more"])
    assert 1.0 <= result["tau"] <= 3.0
    with pytest.raises(ValueError, match="holds no .safetensors files"):
        train_head("eagle3", cfg, target_dir, tmp_path / "head2", k=2,
                   hidden_states=tmp_path / "empty")


def test_a_peagle_head_reports_its_chain_and_its_one_pass(tiny_lm, tmp_path):
    """A P-EAGLE head trained on extracted states drafts as a chain too (its first copy is the
    chain's first step): its chat quality holds tau per K for both ways, greedy and sampled."""
    from specserve.train.heads import train_head
    target_dir, _, _ = tiny_lm
    _extract(target_dir, tmp_path / "states")
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=3, batch_size=2, seq_len=24,
                      lr=3e-3, warmup=1, eval_every=3, bf16=False, device=DEVICE)
    train_head("eagle3", cfg, target_dir, tmp_path / "pe", k=2, hidden_states=tmp_path / "states",
               head_options={"parallel": True}, chat=True)
    quality = json.loads((tmp_path / "pe" / "quality.json").read_text())
    for key in ("tau_per_k", "tau_per_k_parallel"):
        assert set(quality[key]) == {"temperature 0.0", "temperature 0.7"}
        assert all(set(per_k) == {"1", "2"} and all(1 <= t <= 3 for t in per_k.values())
                   for per_k in quality[key].values())
    assert quality["tau_per_k"]["temperature 0.0"]["1"] == \
        quality["tau_per_k_parallel"]["temperature 0.0"]["1"]      # K=1: the same draft


def test_an_mlp_speculator_takes_its_inner_dim(tiny_lm, tmp_path):
    """--inner-dim sizes the speculator's state (its two vocabulary matrices dominate its
    bytes); the option is the MLP speculator's alone."""
    from specserve.cli import main
    from specserve.train.heads import train_head
    target_dir, _, _ = tiny_lm
    _extract(target_dir, tmp_path / "states")
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=2, batch_size=2, seq_len=24,
                      warmup=1, bf16=False, device=DEVICE)
    train_head("mlp_speculator", cfg, target_dir, tmp_path / "mlp", k=2,
               hidden_states=tmp_path / "states", head_options={"inner_dim": 8})
    written = json.loads((tmp_path / "mlp" / "config.json").read_text())
    assert (written["inner_dim"], written["tie_weights"]) == (8, True)
    weights = load_file(str(tmp_path / "mlp" / "model.safetensors"))
    assert weights["head.0.weight"].shape[1] == 8 and "head.1.weight" not in weights
    with pytest.raises(SystemExit, match="--inner-dim is for mlp_speculator"):
        main(["train", "eagle3", "--target", str(target_dir), "--out", str(tmp_path / "x"),
              "--inner-dim", "8"])
    with pytest.raises(SystemExit, match="--chain-weight is for eagle3 --parallel"):
        main(["train", "eagle3", "--target", str(target_dir), "--out", str(tmp_path / "x"),
              "--chain-weight", "1"])


def test_hidden_state_files_are_bounded_and_need_a_directory(tiny_lm, tmp_path):
    target_dir, _, _ = tiny_lm
    llm = LLM(str(target_dir), device=DEVICE, speculative_config={
        "method": "extract_hidden_states", "hidden_states_dir": str(tmp_path / "s"),
        "hidden_states_max_bytes": 1})
    llm.generate(["def f(x):", "import os"], SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)
    assert len(list((tmp_path / "s").glob("*.safetensors"))) == 1      # then the bound held
    with pytest.raises(ValueError, match="needs 'hidden_states_dir'"):
        LLM(str(target_dir), device=DEVICE,
            speculative_config={"method": "extract_hidden_states"})
