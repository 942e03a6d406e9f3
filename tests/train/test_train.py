"""Tokenizer round trip, a seconds-long pretraining and distillation run, the bundled zoo."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.data.corpus import Corpus, read_text
from specserve.train.bpe import train_bpe
from specserve.train.generated import GeneratedData, corpus_openings, mix_generated
from specserve.train.lm import ModelShape, train_draft, train_lm
from specserve.train.trainer import TrainConfig

REPO = Path(__file__).resolve().parents[2]
TINY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_position_embeddings=128)


@pytest.fixture(scope="module")
def small_corpus() -> Corpus:
    c = Corpus.stdlib()
    return Corpus(c.train_files[:12], c.val_files[:2])


def test_corpus_split_is_by_file_and_deterministic():
    a, b = Corpus.stdlib(), Corpus.stdlib()
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert not set(a.train_files) & set(a.val_files)
    assert all("site-packages" not in p.parts for p in a.train_files + a.val_files)


def test_tokenizer_round_trips_corpus_files(small_corpus):
    tok = train_bpe(small_corpus.train_files, vocab_size=600)
    for path in small_corpus.train_files[:4] + small_corpus.val_files:
        text = read_text(path)
        assert tok.decode(tok.encode(text).ids) == text


@pytest.fixture(scope="module")
def tiny_lm(small_corpus, tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    out = tmp_path_factory.mktemp("lm")
    cfg = TrainConfig(work_dir=str(work), steps=40, batch_size=4, seq_len=64, lr=3e-3, warmup=5,
                      eval_every=40, bf16=False, device="cpu")
    bpb = train_lm(cfg, TINY, out, vocab_size=400, corpus=small_corpus)
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    return out, bpb, log


def test_training_lowers_loss_and_writes_hf_dir(tiny_lm):
    out, bpb, log = tiny_lm
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < first - 0.5
    assert 0 < bpb < 10
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "loss.png"):
        assert (out / f).is_file(), f
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_trained_model_loads_in_transformers_with_equal_greedy(tiny_lm):
    from transformers import AutoModelForCausalLM
    out, _, _ = tiny_lm
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    llm = LLM(str(out), device="cpu")
    prompt = llm.get_tokenizer().encode("import os\ndef ")
    got = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False)[0, len(prompt):].tolist()
    assert got == ref


def test_resume_continues_from_checkpoint(small_corpus, tiny_lm, tmp_path):
    out, _, _ = tiny_lm
    cfg = TrainConfig(work_dir=str(tmp_path), steps=6, batch_size=2, seq_len=32, warmup=2,
                      ckpt_every=3, eval_every=6, bf16=False, device="cpu", max_minutes=0.0)
    train_lm(cfg, TINY, tmp_path / "out", tokenizer_dir=out, corpus=small_corpus)
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 1  # stopped at once
    cfg.max_minutes = None
    bpb = train_lm(cfg, TINY, tmp_path / "out", tokenizer_dir=out, corpus=small_corpus)
    steps = [json.loads(x)["step"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6] and bpb == bpb


def test_staged_build_reruns_past_finished_stages(small_corpus, tiny_lm, tmp_path):
    """A staged build (schedules of 4 then 8 steps) rerun from the start after the second stage
    has begun: the first stage is already behind the checkpoint and is skipped (it used to fail
    looking for its validation result), the second resumes."""
    target, _, _ = tiny_lm
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, tie_embeddings=True, max_position_embeddings=128)

    def stage(steps: int, max_minutes: float | None = None) -> float:
        cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=steps, batch_size=2, seq_len=32,
                          warmup=1, eval_every=4, ckpt_every=1, bf16=False, device="cpu",
                          max_minutes=max_minutes)
        return train_draft(cfg, shape, target, tmp_path / "draft", corpus=small_corpus)

    first = stage(4)
    for _ in range(2):
        assert math.isnan(stage(8, max_minutes=0.0))     # stopped after one step: resume later
    assert json.loads((tmp_path / "w" / "checkpoint.json").read_text())["step"] == 6
    assert stage(4) == first                        # behind the checkpoint: skipped
    assert stage(8) == stage(8) and (tmp_path / "draft" / "config.json").is_file()
    assert stage(4) == first                        # its own result, not the later stage's


def test_staged_head_build_skips_finished_stages(small_corpus, tiny_lm, tmp_path):
    """A head stage the checkpoint has already passed reports itself skipped (not unfinished,
    which would stop `zoo build`) and leaves the later stage's head in place."""
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm

    def stage(steps: int) -> dict:
        cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=steps, batch_size=2, seq_len=32,
                          warmup=1, ckpt_every=1, bf16=False, device="cpu")
        return train_head("medusa", cfg, target, tmp_path / "medusa", k=2,
                          gen=GeneratedData(num_generated=1, generated_len=8),
                          corpus=small_corpus)

    assert "tau" in stage(3) and "tau" in stage(5)
    written = (tmp_path / "medusa" / "model.safetensors").read_bytes()
    assert "step 5" in stage(3)["skipped"]
    assert (tmp_path / "medusa" / "model.safetensors").read_bytes() == written


def test_draft_distillation_lowers_kl(small_corpus, tiny_lm, tmp_path):
    target, _, _ = tiny_lm
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, tie_embeddings=True, max_position_embeddings=128)
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=30, batch_size=4, seq_len=64, lr=3e-3,
                      warmup=3, eval_every=30, bf16=False, device="cpu")
    gen = GeneratedData(num_generated=3, generated_len=12, generated_temperature=0,
                        generated_share=0.2)
    train_draft(cfg, shape, target, tmp_path / "draft", corpus=small_corpus, gen=gen)
    greedy = np.load(tmp_path / "w" / "generated-3x12-t0.npy")
    assert len(greedy) > 3 * 12
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["kl"] < log[0]["kl"] * 0.7
    llm = LLM(str(target), device="cpu", speculative_config={
        "model": str(tmp_path / "draft"), "num_speculative_tokens": 2})
    llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.get_metrics()["spec_decode_num_drafts"] > 0


def test_generated_share_of_the_training_text():
    corpus, gen = np.arange(900), np.arange(1000, 1010)
    assert len(mix_generated(corpus, gen, 0.0)) == 910                  # appended once
    mixed = mix_generated(corpus, gen, 0.25)
    share = (mixed >= 1000).mean()
    assert 0.25 <= share < 0.26 and (mixed[:900] == corpus).all()
    with pytest.raises(ValueError, match=r"generated_share must be in \[0, 1\)"):
        GeneratedData(generated_share=1.0)


def test_greedy_continuations_extend_a_smaller_cache(monkeypatch, tmp_path):
    """More greedy continuations than a work directory holds: only the new openings are
    generated, after the cached ones; sampled ones are generated whole."""
    import specserve.train.generated as generated
    calls = []

    def fake(target_dir, corpus, num, length, seed, temperature, skip=0):
        calls.append((num, skip))
        return np.arange(skip, num) * 10           # one "token" per continuation
    monkeypatch.setattr(generated, "generated_tokens", fake)
    np.save(tmp_path / "generated-3x16-t0.npy", np.array([0, 10, 20]))
    np.save(tmp_path / "generated-9x16-t0.npy", np.array([-1]))            # a larger one: unused
    ids = generated.with_generated(np.zeros(0, dtype=np.int64), GeneratedData(
        num_generated=5, generated_len=16, generated_temperature=0), Path("t"), None, tmp_path, 0)
    assert calls == [(5, 3)] and ids.tolist() == [0, 10, 20, 30, 40]
    assert np.load(tmp_path / "generated-5x16-t0.npy").tolist() == [0, 10, 20, 30, 40]
    np.save(tmp_path / "generated-3x16-t0.7.npy", np.array([0, 10, 20]))
    generated.with_generated(np.zeros(0, dtype=np.int64), GeneratedData(
        num_generated=5, generated_len=16, generated_temperature=0.7), Path("t"), None,
        tmp_path, 0)
    assert calls[-1] == (5, 0)


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


def test_more_openings_than_files_start_at_later_lines(small_corpus):
    """Past one opening per file, later ones start at line starts further into the files; the
    first pass is each non-empty file's beginning (as the zoo recipe had)."""
    files = [f for f in small_corpus.train_files if read_text(f).strip()]
    ops = corpus_openings(small_corpus, 3 * len(files), seed=0)
    assert len(ops) == 3 * len(files)
    assert sorted(ops[:len(files)]) == sorted(read_text(f)[:400] for f in files)
    later = ops[len(files):]
    assert not set(later) & set(ops[:len(files)])
    assert all(any(("\n" + o) in read_text(f) for f in files) for o in later)
    assert corpus_openings(small_corpus, 5, seed=0) == ops[:5]


def test_greedy_top1_probs_are_the_targets_top_probabilities():
    from specserve.models.loader import load_model
    from specserve.train.evaluate import greedy_completions, greedy_top1_probs
    from specserve.train.trainer import _positions
    target = str(REPO / "models" / "code-target")
    out = greedy_completions(target, ["def add(a, b):\n"], max_tokens=12)
    probs = greedy_top1_probs(out)
    seq = torch.tensor(out[0].prompt_token_ids + out[0].outputs[0].token_ids)[None]
    model = load_model(target, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        p = model.compute_logits(model(seq, _positions(seq)))[0].softmax(-1)      # [S, V]
    n = len(out[0].prompt_token_ids)
    top = p[n - 1:-1].max(-1).values
    assert len(probs) == 12 and torch.allclose(torch.tensor(probs), top, atol=1e-4)


@pytest.mark.parametrize("name", ["code-target", "code-draft"])
def test_bundled_models_load_and_generate(name):
    path = REPO / "models" / name
    assert (path / "config.json").is_file(), f"bundled model {path} is missing"
    llm = LLM(str(path), device="cpu")
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=16),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 1 and out.text.strip()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "mlp_speculator", "mtp"])
def test_bundled_heads_speculate_losslessly(method):
    """Every bundled head loads for the bundled target, drafts, and keeps greedy output."""
    from specserve.bench.methods import spec_config
    model, spec = spec_config(method, 4, str(REPO / "models" / "code-target"), "")
    assert (Path(spec.get("model", model)) / "config.json").is_file(), f"{method} head missing"
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "def fibonacci(n):\n    "
    ref = LLM(str(REPO / "models" / "code-target"), device="cpu").generate(prompt, sp,
                                                                          use_tqdm=False)
    llm = LLM(model, device="cpu", speculative_config=spec)
    got = llm.generate(prompt, sp, use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("method, draft_vocab, top1", [
    ("medusa", None, 0), ("mlp_speculator", None, 0), ("eagle", None, 0), ("eagle3", None, 0),
    ("eagle3", 100, 1.0), ("mtp", None, 0)])
def test_head_training_smoke(method, draft_vocab, top1, tiny_lm, small_corpus, tmp_path):
    """Seconds of training lower the loss, write the public format, and the head loads and
    speculates losslessly with a measured tau."""
    from specserve.train.heads import train_head
    target, _, _ = tiny_lm
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=25, batch_size=4, seq_len=64, lr=3e-3,
                      warmup=2, eval_every=25, bf16=False, device="cpu", top1_weight=top1)
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
    ref = LLM(str(target), device="cpu").generate("def f(x):", sp, use_tqdm=False)
    got = LLM(str(model), device="cpu", speculative_config=spec).generate("def f(x):", sp,
                                                                          use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    if method == "mtp":     # the target's weights are linked, not copied
        shards = [f for f in model.iterdir() if f.suffix == ".safetensors"]
        assert [f.name for f in shards if not f.is_symlink()] == ["model-mtp.safetensors"]


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
                          lr=lr, warmup=1, bf16=False, device="cpu")
        return train_head(method, cfg, target, tmp_path / out, k=2, gen=gen,
                          corpus=small_corpus, draft_vocab=100 if method == "eagle3" else None,
                          **kw)

    run("w1", "first", 3e-3)
    run("w2", "again", 0.0, init=tmp_path / "first")
    _assert_same_weights(tmp_path / "first", tmp_path / "again")
    with pytest.raises(ValueError, match="does not match"):
        cfg = TrainConfig(work_dir=str(tmp_path / "w3"), steps=1, batch_size=2, seq_len=32,
                          bf16=False, device="cpu")
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
                          lr=lr, warmup=1, bf16=False, device="cpu")
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
                          bf16=False, device="cpu")
        train_head("medusa", cfg, target, tmp_path / "x", k=2, gen=gen, corpus=small_corpus,
                   init=tmp_path / "first", refresh_vocab=True)


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0)


def test_draft_training_starts_from_init(small_corpus, tiny_lm, tmp_path):
    target, _, _ = tiny_lm
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, tie_embeddings=True, max_position_embeddings=128)

    def run(work: str, out: str, lr: float, **kw) -> None:
        cfg = TrainConfig(work_dir=str(tmp_path / work), steps=4, batch_size=2, seq_len=32,
                          lr=lr, warmup=1, bf16=False, device="cpu")
        train_draft(cfg, shape, target, tmp_path / out, corpus=small_corpus, **kw)

    run("w1", "first", 3e-3)
    run("w2", "again", 0.0, init=tmp_path / "first")
    _assert_same_weights(tmp_path / "first", tmp_path / "again")


def test_repeat_mask_marks_every_token_of_a_repeated_ngram():
    from specserve.train.unlikelihood import repeat_mask
    rows = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    assert repeat_mask(rows, 4).tolist() == [
        [False] * 4 + [True] * 4 + [False], [False] * 9]
    assert repeat_mask(torch.tensor([[7, 7, 7, 7, 7]]), 2).tolist() == [[False] + [True] * 4]


def test_greedy_rollouts_match_the_engine(tiny_lm):
    from specserve.models.loader import load_model
    from specserve.train.unlikelihood import greedy_rollouts
    out, _, _ = tiny_lm
    model = load_model(out, torch.float32, torch.device("cpu"))
    prefixes = torch.tensor([[5, 17, 30, 2, 99, 41], [8, 8, 120, 3, 7, 64]])
    got = greedy_rollouts(model, prefixes, 10)
    llm = LLM(str(out), device="cpu")
    ref = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prefixes.tolist()],
                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)
    assert got.tolist() == [o.outputs[0].token_ids for o in ref]


def test_unlikelihood_fine_tuning_reduces_greedy_repeats(tiny_lm, small_corpus, tmp_path):
    """The tiny model loops under greedy decoding; unlikelihood steps make it loop less on
    openings it was not trained on, and the output is a loadable HF directory."""
    from specserve.models.loader import load_model
    from specserve.train.unlikelihood import (
        UnlikelihoodConfig,
        greedy_rollouts,
        repeat_mask,
        train_unlikelihood,
    )
    out, _, _ = tiny_lm
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = read_text(small_corpus.val_files[0])
    ids = tok.encode(text).ids
    prefixes = torch.tensor([ids[i:i + 16] for i in range(0, 8 * 40, 40)])   # [8, 16]

    def repeats(model_dir: Path) -> float:
        model = load_model(model_dir, torch.float32, torch.device("cpu"))
        return repeat_mask(greedy_rollouts(model, prefixes, 48), 4).float().mean().item()

    before = repeats(out)
    assert before > 0.3, "the tiny model should loop before fine-tuning"
    cfg = TrainConfig(work_dir=str(tmp_path / "w"), steps=30, batch_size=4, seq_len=64,
                      lr=2e-3, warmup=2, eval_every=30, bf16=False, device="cpu")
    # the tiny model is nearly uniform: its repeats have small p, hence a large weight
    ul = UnlikelihoodConfig(ul_weight=20.0, prefix_len=16, rollout_len=48, ngram=4)
    bpb = train_unlikelihood(cfg, ul, out, tmp_path / "ul", corpus=small_corpus)
    assert 0 < bpb < 10
    after = repeats(tmp_path / "ul")
    assert after < before * 0.6, (before, after)
    LLM(str(tmp_path / "ul"), device="cpu").generate("def f(x):", SamplingParams(max_tokens=4),
                                                     use_tqdm=False)


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
                      warmup=2, eval_every=25, bf16=False, device="cpu")
    outs = {"medusa": tmp_path / "tiny-medusa", "mlp_speculator": tmp_path / "tiny-mlp"}
    results = train_heads(outs, cfg, target, k=3, gen=GeneratedData(num_generated=2,
                          generated_len=16), corpus=small_corpus)
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    for key in ("medusa_loss", "mlp_speculator_loss"):
        assert sum(r[key] for r in log[-3:]) < sum(r[key] for r in log[:3])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(target), device="cpu").generate("def f(x):", sp, use_tqdm=False)
    for method, out in outs.items():
        assert 1.0 <= results[method]["tau"] <= 4.0
        got = LLM(str(target), device="cpu", speculative_config={
            "method": method, "model": str(out), "num_speculative_tokens": 3}).generate(
            "def f(x):", sp, use_tqdm=False)
        assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="train it alone"):
        train_heads({"eagle3": tmp_path / "a", "eagle": tmp_path / "b"}, cfg, target)


def test_zoo_build_goes_on_past_skipped_head_stages(monkeypatch, tmp_path, capsys):
    """`zoo build` rerun after a head stage was passed: the passed stage reports 'skipped' and the
    build goes on to the next stage and the next head group (the training calls are stubbed)."""
    from specserve.train import zoo
    monkeypatch.setattr(zoo, "train_lm", lambda *a, **k: 1.0)
    monkeypatch.setattr(zoo, "train_unlikelihood", lambda *a, **k: 1.0)
    monkeypatch.setattr(zoo, "train_draft", lambda *a, **k: 1.0)
    calls, refreshed = [], []

    def heads(outs, cfg, *a, **k):
        calls.append(cfg.steps)
        refreshed.append((k.get("refresh_vocab", False), cfg.lr, cfg.seed, cfg.top1_weight))
        first = cfg.steps == min(s for _, _, st in zoo.HEAD_RECIPES.values() for s, _ in st)
        return {m: {"skipped": "past"} if first else {"tau": 2.0} for m in outs}

    monkeypatch.setattr(zoo, "train_heads", heads)
    zoo.build_zoo(str(tmp_path / "models"), str(tmp_path / "work"))
    assert calls == ([s for _, _, st in zoo.HEAD_RECIPES.values() for s, _ in st]
                     + [s for s, _ in zoo.RETARGET_HEADS.values()]
                     + [s.steps for s in zoo.RETARGET_EAGLE3_MORE])
    assert refreshed[-len(zoo.RETARGET_EAGLE3_MORE):] == [
        (s.refresh_vocab, s.lr, s.seed, s.top1_weight) for s in zoo.RETARGET_EAGLE3_MORE]
    out = capsys.readouterr().out
    assert "past" in out and "tau 2.00 at K=4" in out
