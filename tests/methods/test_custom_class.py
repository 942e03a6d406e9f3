"""custom_class: a user's proposer by dotted path, built from the DraftContext; the example's
dictionary proposer runs losslessly; a class that is not a Proposer is refused by name."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.methods import resolve_speculative_config
from tests.conftest import DEVICE

REPO = Path(__file__).resolve().parents[2]
TARGET = str(REPO / "models" / "code-target")
PARAMS = SamplingParams(temperature=0, max_tokens=32)


def test_the_examples_dictionary_proposer_is_lossless(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import custom_proposer
    prompts = ["def fibonacci(n):", "class Stack:"]
    ref = LLM(TARGET, device=DEVICE).generate(prompts, PARAMS, use_tqdm=False)
    # one known answer (the first prompt's), one unknown prompt
    monkeypatch.setitem(custom_proposer.COMPLETIONS, prompts[0], ref[0].outputs[0].text)
    llm = LLM(TARGET, device=DEVICE, speculative_config={
        "model": "custom_proposer.DictionaryProposer", "num_speculative_tokens": 4})
    assert llm.engine.spec.method == "custom_class"        # detected from the dotted path
    got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    stats = llm.get_stats()
    assert stats["dictionary_drafts"] > 0 and stats["mean_acceptance_length"] > 3.5


def test_the_example_script_runs():
    import os
    import subprocess
    out = subprocess.run([sys.executable, "examples/custom_proposer.py"], cwd=REPO,
                         env=os.environ | {"PYTHONPATH": "examples"}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "steps drafted from the dictionary" in out.stdout


def test_a_class_that_is_not_a_proposer_is_refused_by_what_it_lacks(monkeypatch):
    mod = types.ModuleType("my_drafters")

    class HalfDone:
        def __init__(self, config, ctx):
            pass

        def propose(self, batch):
            return []
    mod.HalfDone = HalfDone
    monkeypatch.setitem(sys.modules, "my_drafters", mod)
    with pytest.raises(ValueError, match="lacks finish, reset, stats, aux_hidden_layers, "
                                         "caches, max_model_len, modules"):
        LLM(TARGET, device=DEVICE, speculative_config={"model": "my_drafters.HalfDone",
                                                      "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="could not import 'my_drafters.Nope'"):
        LLM(TARGET, device=DEVICE, speculative_config={"model": "my_drafters.Nope",
                                                      "num_speculative_tokens": 2})


def test_vllms_detection_order():
    assert resolve_speculative_config({"model": "ngram", "num_speculative_tokens": 2}).method \
        == "ngram"
    assert resolve_speculative_config({"model": "a.b.C", "num_speculative_tokens": 2}).method \
        == "custom_class"
    mtp = resolve_speculative_config({"num_speculative_tokens": 2},
                                     str(REPO / "models" / "code-target-mtp"))
    assert mtp.method == "mtp"
    with pytest.raises(ValueError, match="needs 'method'"):
        resolve_speculative_config({"num_speculative_tokens": 2}, TARGET)
