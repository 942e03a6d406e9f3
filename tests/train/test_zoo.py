"""The bundled zoo: it loads, speculates losslessly, is listed in MANIFEST; the build recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from tests.conftest import DEVICE
from tests.train.conftest import REPO


@pytest.mark.parametrize("name", ["code-target", "code-draft"])
def test_bundled_models_load_and_generate(name):
    path = REPO / "models" / name
    assert (path / "config.json").is_file(), f"bundled model {path} is missing"
    llm = LLM(str(path), device=DEVICE)
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
    ref = LLM(str(REPO / "models" / "code-target"), device=DEVICE).generate(prompt, sp,
                                                                          use_tqdm=False)
    llm = LLM(model, device=DEVICE, speculative_config=spec)
    got = llm.generate(prompt, sp, use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.get_stats()["spec_decode_num_accepted_tokens"] > 0


# the bundled one-pass drafters: directory, speculative_config keys, the method detected, the
# least mean acceptance length on two held-out prompts
ONE_PASS = {
    "pard": ("code-draft-pard", {"num_speculative_tokens": 8, "parallel_drafting": True},
             "draft_model", 1.0),
    "peagle": ("code-target-eagle3-parallel", {"num_speculative_tokens": 2,
                                               "parallel_drafting": True}, "eagle3", 1.5),
    "dflash": ("code-target-dflash", {}, "dflash", 1.5)}


@pytest.mark.parametrize("name", sorted(ONE_PASS))
def test_the_bundled_one_pass_drafters_are_lossless_and_accept(name):
    """PARD, P-EAGLE and DFlash draft for the bundled target in one pass, greedy output kept;
    the method is detected from the checkpoint."""
    directory, keys, method, least_tau = ONE_PASS[name]
    target, drafter = REPO / "models" / "code-target", REPO / "models" / directory
    assert (drafter / "config.json").is_file(), f"the bundled {name} drafter is missing"
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n"]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(str(target), device=DEVICE).generate(
        prompts, sp, use_tqdm=False)]
    llm = LLM(str(target), device=DEVICE, speculative_config={"model": str(drafter)} | keys)
    assert llm.engine.spec.method == method
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
    stats = llm.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["mean_acceptance_length"] > least_tau


def test_zoo_build_goes_on_past_skipped_head_stages(monkeypatch, tmp_path, capsys):
    """`zoo build` rerun after a head stage was passed: the passed stage reports 'skipped' and the
    build goes on to the next stage and the next head group (the training calls are stubbed)."""
    from specserve.train import zoo
    monkeypatch.setattr(zoo, "train_lm", lambda *a, **k: 1.0)
    monkeypatch.setattr(zoo, "train_unlikelihood", lambda *a, **k: 1.0)
    monkeypatch.setattr(zoo, "train_draft", lambda *a, **k: 1.0)
    pard = []
    monkeypatch.setattr(zoo, "train_pard", lambda cfg, draft, target, out, **k: pard.append(
        (draft.name, target.name, out.name, k["k"], k["depth_gamma"], cfg.lr, cfg.seed,
         cfg.top1_weight)) or 1.0)
    calls, refreshed, shapes, inits = [], [], [], []

    def heads(outs, cfg, *a, **k):
        calls.append(cfg.steps)
        shapes.append((list(outs), k.get("k"), k.get("head_options")))
        refreshed.append((k.get("refresh_vocab", False), cfg.lr, cfg.seed, cfg.top1_weight))
        inits.append(k.get("inits"))
        first = cfg.steps == min(s for _, _, st in zoo.HEAD_RECIPES.values() for s, _ in st)
        return {m: {"skipped": "past"} if first else {"tau": 2.0} for m in outs}

    monkeypatch.setattr(zoo, "train_heads", heads)
    zoo.build_zoo(str(tmp_path / "models"), str(tmp_path / "work"))
    more = [s.steps for s in zoo.DFLASH_MORE]
    pe_more = [s.steps for s in zoo.PEAGLE_MORE]
    late = ([s for s, _, _ in zoo.DFLASH_STAGES] + more + [s for s, _ in zoo.PEAGLE_STAGES]
            + pe_more)
    assert calls == ([s for _, _, st in zoo.HEAD_RECIPES.values() for s, _ in st]
                     + [s for s, _ in zoo.RETARGET_HEADS.values()]
                     + [s.steps for s in zoo.RETARGET_EAGLE3_MORE] + late)
    assert refreshed[-len(late) - len(zoo.RETARGET_EAGLE3_MORE):-len(late)] == [
        (s.refresh_vocab, s.lr, s.seed, s.top1_weight) for s in zoo.RETARGET_EAGLE3_MORE]
    # DFlash's fine-tunes start from the drafter the stages before wrote, with their settings
    n_peagle = len(zoo.PEAGLE_STAGES) + len(pe_more)
    dfl = slice(-n_peagle - len(more), -n_peagle)
    assert refreshed[dfl] == [(False, s.lr, s.seed, s.top1_weight) for s in zoo.DFLASH_MORE]
    assert all(i and i["dflash"].name == "code-target-dflash" for i in inits[dfl])
    assert inits[dfl.start - 1] is None
    out = capsys.readouterr().out
    assert "past" in out and "tau 2.00" in out
    # PARD's stages adapt the draft; its fine-tunes start from what they wrote
    pard_cfg = zoo.pard_config(tmp_path, 1)
    assert pard == [("code-draft", "code-target", "code-draft-pard", zoo.PARD_K,
                     zoo.PARD_DEPTH_GAMMA, pard_cfg.lr, pard_cfg.seed, 0.0)] * len(
        zoo.PARD_STAGES) + [("code-draft-pard", "code-target", "code-draft-pard", zoo.PARD_K,
                             zoo.PARD_DEPTH_GAMMA, s.lr, s.seed, s.top1_weight)
                            for s in zoo.PARD_MORE]
    assert shapes[-n_peagle:] == [(["eagle3"], zoo.PEAGLE_K, {
        "parallel": True, "depth_gamma": zoo.PEAGLE_DEPTH_GAMMA})] * n_peagle
    # P-EAGLE starts from the EAGLE-3 head; its fine-tunes from what the stage before wrote
    assert [i["eagle3"].name for i in inits[-n_peagle:]] == ["code-target-eagle3"] * len(
        zoo.PEAGLE_STAGES) + ["code-target-eagle3-parallel"] * len(pe_more)
    assert refreshed[-len(pe_more):] == [(False, s.lr, s.seed, s.top1_weight)
                                         for s in zoo.PEAGLE_MORE]


def test_the_manifest_lists_every_bundled_file_as_it_is():
    """models/MANIFEST is current: a weight changed without a zoo release (or a file added
    without its line) fails here; `specserve zoo manifest` regenerates it."""
    from specserve.train.zoo import manifest
    assert (REPO / "models" / "MANIFEST").read_text() == manifest(REPO / "models")
