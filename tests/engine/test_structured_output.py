"""Structured output with speculation: outputs follow the grammar with every method, greedy
output equals the masked target's without drafts, the grammar never keeps a draft, and the
sampled distribution is the masked target's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams, StructuredOutputsParams
from specserve.engine.structured_output import Grammars
from tests.conftest import DEVICE, make_hf_model
from tests.methods.test_dflash import make_dflash
from tests.methods.test_heads import eagle3_ckpt
from tests.methods.test_pard import _with_mask
from tests.methods.test_peagle import make_peagle

SCHEMA = {"type": "object", "properties": {
    "a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}, "c": {"type": "string", "maxLength": 5},
    "d": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
          "maxItems": 3}},
    "required": ["a", "b", "c", "d"], "additionalProperties": False}
PROMPTS = ["hello", "def add(a, b):", "world", "return"]


def valid(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"a", "b", "c", "d"} and obj["a"] in (1, 2, 3)
            and isinstance(obj["b"], bool) and isinstance(obj["c"], str) and len(obj["c"]) <= 5
            and len(obj["d"]) <= 3 and all(isinstance(x, int) and 0 <= x <= 99 for x in obj["d"]))


def random_head(method: str, target_dir, out):
    """A random head of `method` for the target in `target_dir`, written in its format."""
    from specserve import methods
    from specserve.models.loader import load_model
    torch.manual_seed(0)
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    spec = methods.get(method)
    head = spec.new_head(target, 3, None, np.ones(target.args.vocab_size, dtype=np.int64))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() >= 2:
                p.normal_(0, 0.15)
    spec.write(head, out, target_dir, torch.float32)
    return out


@pytest.fixture(scope="module")
def specs(text_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("so-drafters")
    V = json.loads((text_model_dir / "config.json").read_text())["vocab_size"]
    make_hf_model("llama", root / "draft", seed=1, vocab=V, hidden_size=32, num_hidden_layers=1,
                  intermediate_size=64)
    e3 = eagle3_ckpt(root / "e3", vocab=V)
    return {"none": None,
            "ngram": {"method": "ngram", "prompt_lookup_min": 1},
            "suffix": {"method": "suffix"},
            "draft_model": {"method": "draft_model", "model": str(root / "draft")},
            "self_draft": {"method": "draft_model", "model": str(text_model_dir)},
            "eagle3": {"method": "eagle3", "model": str(e3)},
            "eagle3_tree": {"method": "eagle3", "model": str(e3), "num_speculative_tokens": 4,
                            "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"},
            "dflash": {"method": "dflash",
                       "model": str(make_dflash(text_model_dir, root / "dflash", mask=V - 2))},
            "pard": {"method": "draft_model", "parallel_drafting": True,
                     "model": str(_with_mask(root / "draft", root / "pard", mask=V - 2))},
            "peagle": {"method": "eagle3", "parallel_drafting": True,
                       "model": str(make_peagle(text_model_dir, root / "peagle", mask=V - 2))},
            **{m: {"method": m, "model": str(random_head(m, text_model_dir, root / m))}
               for m in ("eagle", "medusa", "mlp_speculator", "mtp")}}


def _llm(model, spec):
    return LLM(str(model), device=DEVICE, speculative_config=None if spec is None else
               {"num_speculative_tokens": 3} | spec)


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=60,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


@pytest.mark.parametrize("name", ["none", "ngram", "suffix", "draft_model", "self_draft",
                                  "eagle3", "eagle3_tree", "dflash", "eagle", "medusa",
                                  "mlp_speculator", "mtp", "pard", "peagle"])
def test_schema_valid_and_greedy_equal_to_no_spec(name, specs, text_model_dir):
    ref = [o.outputs[0] for o in _llm(text_model_dir, None).generate(
        PROMPTS, _params(), use_tqdm=False)]
    llm = _llm(text_model_dir, specs[name])
    out = [o.outputs[0] for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
    assert all(valid(o.text) for o in out), [o.text for o in out]
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    m = llm.get_stats()
    if specs[name] is not None and name != "suffix":
        assert m["spec_decode_num_draft_tokens"] > 0
    if name == "self_draft":                 # the target drafting for itself: all accepted
        assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]


def test_a_draft_the_grammar_rejects_ends_the_proposal(specs, text_model_dir):
    """Unconstrained, the self-draft is always accepted; under the schema its chains are cut
    where the grammar refuses, and what is drafted is accepted."""
    llm = _llm(text_model_dir, specs["self_draft"])
    proposer, seen = llm.engine.proposer, []
    propose = proposer.propose

    def recording(batch):
        out = propose(batch)
        seen.extend(len(p.token_ids) for p in out)
        return out
    proposer.propose = recording
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    m = llm.get_stats()
    assert m["spec_decode_num_draft_tokens"] < sum(seen)             # some chains were cut
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]


def test_the_grammar_never_keeps_a_draft(text_model_dir):
    """mask_rows leaves the matcher where it was; consuming the accepted prefix then gives the
    state a fresh matcher reaches on the same tokens."""
    llm = _llm(text_model_dir, None)
    g: Grammars = llm.engine.grammars
    so = StructuredOutputsParams(json=SCHEMA)
    tok = llm.get_tokenizer()
    text = tok.encode('{"a": 2, "b": true, "c": "x", "d": [1, 22]}')
    m = g.matcher(so)
    m.consume_tokens(text[:3])
    before = m.compute_bitmask()
    drafts = text[3:9] + [0]
    logits = torch.zeros(len(drafts) + 1, llm.engine.vocab_size)
    g.mask_rows(m, logits, drafts, None)
    assert m.compute_bitmask() == before
    for i in range(1, len(drafts)):          # row i: the state after the first i drafts
        ref = g.matcher(so)
        ref.consume_tokens(text[:3 + i])
        allowed = torch.isfinite(logits[i]).nonzero().flatten().tolist()
        assert text[3 + i] in allowed and ref.validate_tokens(allowed[:1]) == 1
    m.consume_tokens(text[3:6])              # three drafts accepted, the rest rejected
    fresh = g.matcher(so)
    fresh.consume_tokens(text[:6])
    assert m.compute_bitmask() == fresh.compute_bitmask()


@pytest.mark.parametrize("kind, check", [
    ({"choice": ["yes", "no way", "maybe"]}, lambda t: t in ("yes", "no way", "maybe")),
    ({"regex": r"[0-9]{3}-[a-z]{2,6}"}, lambda t: t[:3].isdigit() and t[3] == "-"
     and 2 <= len(t[4:]) <= 6 and t[4:].isalpha()),
    ({"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'},
     lambda t: t[0] == "(" and t[-1] == ")" and all(x.isdigit() for x in t[1:-1].split(","))),
    ({"grammar": 'root ::= "[" [a-c]+ "]"'}, lambda t: t[0] == "[" and t[-1] == "]"
     and set(t[1:-1]) <= set("abc")),
])
def test_each_kind_of_constraint_with_sampling(kind, check, specs, text_model_dir):
    llm = _llm(text_model_dir, specs["draft_model"])
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(**kind))
              for s in range(6)]
    outs = [o.outputs[0] for o in llm.generate(["hello"] * 6, params, use_tqdm=False)]
    # a random model may go on inside an unbounded rule until max_tokens; the others end it
    done = [o.text for o in outs if o.finish_reason == "stop"]
    assert len(done) >= 4 and all(check(t) for t in done), [o.text for o in outs]
    assert all(len(o.token_ids) == 40 for o in outs if o.finish_reason != "stop")


def test_any_json_object(specs, text_model_dir):
    """json_object: an object of any keys; a random model may write one key until max_tokens,
    the ones that finish parse."""
    llm = _llm(text_model_dir, specs["draft_model"])
    so = StructuredOutputsParams(json_object=True)
    outs = [o.outputs[0] for o in llm.generate(["hello"] * 8, [SamplingParams(
        temperature=0.9, seed=s, max_tokens=40, structured_outputs=so) for s in range(8)],
        use_tqdm=False)]
    done = [o.text for o in outs if o.finish_reason == "stop"]
    assert len(done) >= 4 and all(isinstance(json.loads(t), dict) for t in done)
    assert all(o.text.startswith("{") for o in outs)


def test_sampled_distribution_is_the_masked_targets(text_model_dir, specs):
    """First tokens under a choice grammar, sampled with speculation (drafts verified by
    rejection sampling) and without, from the same masked target: the same distribution."""
    so = StructuredOutputsParams(choice=["ab", "b", "hello", "world", "def"])
    n = 400
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured_outputs=so)
              for s in range(n)]
    hist = []
    for spec in (None, specs["draft_model"]):
        outs = _llm(text_model_dir, spec).generate(["x"] * n, params, use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        assert set(texts) <= set(so.choice)
        hist.append(torch.tensor([texts.count(c) for c in so.choice], dtype=torch.float) / n)
    assert (hist[0] - hist[1]).abs().max() < 0.1, hist


@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"json": {"type": "object"}, "regex": "a"}, "got json, regex"),
    ({"choice": []}, "non-empty list"),
])
def test_bad_params_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kw)


@pytest.mark.parametrize("so", [StructuredOutputsParams(regex="(unclosed"),
                                StructuredOutputsParams(grammar="start: UNDEFINED_RULE")])
def test_a_bad_grammar_is_a_clear_error(so, text_model_dir):
    with pytest.raises(ValueError, match="structured_outputs"):
        _llm(text_model_dir, None).generate("x", SamplingParams(structured_outputs=so),
                                            use_tqdm=False)
