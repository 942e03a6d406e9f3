"""Per-token mask cost of the grammar engines specserve could use, with SmolLM2's 49,152-token
vocabulary on this CPU: compile a JSON schema, then walk a valid JSON document token by token,
computing the allowed-token mask before each token. Prints median microseconds per mask.

    pip install llguidance xgrammar && python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import time

from specserve.models.catalogue import resolve_model
from specserve.models.loader import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "active": {"type": "boolean"}}, "required": ["name", "age", "tags", "active"],
    "additionalProperties": False}
DOC = '{"name":"Ada Lovelace","age":36,"tags":["math","engines","poetry"],"active":true}'


def timed(step, tokens):
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        step(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    ids = tok.encode(DOC)
    raw, V, eos = tok._tok.to_str(), tok.vocab_size, tok.eos_token_id
    out = {}

    import llguidance
    import llguidance.torch as lt
    ll_tok = llguidance.LLTokenizer(raw, n_vocab=V, eos_token=eos)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    mask = lt.allocate_token_bitmask(1, V)

    def ll_step(t):
        lt.fill_next_token_bitmask(m, mask, 0)
        assert m.consume_token(t), m.get_error()
    out["llguidance"] = (compile_ms, timed(ll_step, ids))

    import xgrammar as xgr
    info = xgr.TokenizerInfo([tok._tok.id_to_token(i) or "" for i in range(V)],
                             xgr.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    xm = xgr.GrammarMatcher(compiled)
    compile_ms = (time.perf_counter() - t0) * 1e3
    xmask = xgr.allocate_token_bitmask(1, V)

    def xg_step(t):
        xm.fill_next_token_bitmask(xmask, 0)
        assert xm.accept_token(t)
    out["xgrammar"] = (compile_ms, timed(xg_step, ids))

    for name, (c, us) in out.items():
        print(f"{name}: compile {c:.0f} ms, mask {us:.0f} us per token")


if __name__ == "__main__":
    main()
