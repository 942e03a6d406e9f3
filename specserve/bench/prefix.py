"""`specserve bench prefix`: time to the first token with prefix caching on and off.

Two workloads, each request sent alone after the one before has finished:
- shared document: one long document (the source of a standard-library module, cut to
  `--document-tokens` tokens) with a different question each time, through the chat template;
- multi-turn chat: one conversation whose every turn resends the history (the earlier messages
  and the model's answers) with a new question.
The engines with caching on and off are built once and run in interleaved rounds; each round
starts with an empty prefix cache. Greedy outputs of the two are compared.
"""

from __future__ import annotations

import argparse
import email.message
import inspect
import json
import statistics
import time

from specserve.bench import report
from specserve.bench.probes import machine
from specserve.data.chat_prompts import chat_prompts
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

QUESTIONS = ["Summarize what this code does in two sentences.",
             "Which functions does it define? Name three.",
             "What would you test first in this code, and why?",
             "Is there anything in it you would rename?",
             "Explain the first class to a beginner.",
             "Which standard-library modules does it import?"]


def document(llm: LLM, num_tokens: int) -> str:
    """The source of a standard-library module (long, plain Python) cut to about `num_tokens`
    tokens."""
    ids = llm.get_tokenizer().encode(inspect.getsource(email.message))[:num_tokens]
    return llm.get_tokenizer().decode(ids)


def run_workload(llm: LLM, conversations: list[list[dict]], carry: bool,
                 max_tokens: int) -> list[dict]:
    """Send each conversation alone; with `carry` each one continues the one before (its answer
    joins the history before the next question). Per request: prompt and cached tokens, time
    to the first token (ms), the output."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows, history = [], []
    for conv in conversations:
        messages = history + conv if carry else conv
        out = llm.chat([messages], params, use_tqdm=False)[0]
        m = out.metrics
        rows.append({"prompt_tokens": len(out.prompt_token_ids),
                     "cached_tokens": out.num_cached_tokens,
                     "ttft_ms": 1e3 * (m["first_token_time"] - m["arrival_time"]),
                     "output": out.outputs[0].token_ids})
        if carry:
            history = messages + [{"role": "assistant", "content": out.outputs[0].text}]
    return rows


def copy_ms(llm: LLM, prompt: list[int], repeats: int = 7) -> dict:
    """The cache's own cost for `prompt` (median ms of `repeats`): copying its cached blocks into
    a free slot of every cache (target and drafter), and storing them from there. The engine
    must be idle with the prompt's blocks cached."""
    pc, cache = llm.engine.prefix_cache, llm.engine.cache
    slot = cache.allocate()
    copy, store, n = [], [], 0
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            n = pc.lookup(prompt, slot)
            copy.append(time.perf_counter() - t)
            pc.reset()
            t = time.perf_counter()
            pc.insert(prompt, len(prompt), slot)
            store.append(time.perf_counter() - t)
    finally:
        cache.free(slot)
    return {"positions": n, "copy_ms": 1e3 * statistics.median(copy),
            "store_ms": 1e3 * statistics.median(store)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="specserve bench prefix", description=__doc__)
    p.add_argument("mode", choices=["prefix"])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--speculative-config", default=None,
                   help="JSON speculative_config of both engines (default: none)")
    p.add_argument("--document-tokens", type=int, default=1500)
    p.add_argument("--requests", type=int, default=5, help="questions on the document")
    p.add_argument("--turns", type=int, default=5, help="turns of the conversation")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--title", default="Prefix caching: time to the first token")
    report.add_output_args(p)
    a = p.parse_args(argv)
    spec = json.loads(a.speculative_config) if a.speculative_config else None
    # requests are sent one at a time: one KV slot (16 of SmolLM2's 8,192 positions are 6 GB)
    engines = {flag: LLM(a.target, speculative_config=spec, dtype=a.dtype, device="cpu",
                         enable_prefix_caching=flag, freeze_gc=True, max_num_seqs=1)
               for flag in (False, True)}
    doc = document(engines[True], a.document_tokens)
    questions = (QUESTIONS * a.requests)[:a.requests]
    workloads = {
        "shared document": ([[{"role": "user", "content": f"{doc}\n\n{q}"}] for q in questions],
                            False),
        "multi-turn chat": ([[{"role": "user", "content": q}]
                             for q in chat_prompts("heldout")[:a.turns]], True)}
    runs: dict[str, dict[bool, list[list[dict]]]] = {w: {False: [], True: []} for w in workloads}
    for r in range(a.rounds):
        for name, (convs, carry) in workloads.items():
            for flag, llm in engines.items():
                llm.reset_prefix_cache()
                runs[name][flag].append(run_workload(llm, convs, carry, a.max_tokens))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    results = {}
    for name, by_flag in runs.items():
        per_request = []
        for i in range(len(by_flag[True][0])):
            off = [rnd[i] for rnd in by_flag[False]]
            on = [rnd[i] for rnd in by_flag[True]]
            per_request.append({
                "prompt_tokens": on[0]["prompt_tokens"], "cached_tokens": on[0]["cached_tokens"],
                "ttft_ms_off": statistics.median(x["ttft_ms"] for x in off),
                "ttft_ms_on": statistics.median(x["ttft_ms"] for x in on),
                "ttft_ms_off_rounds": [x["ttft_ms"] for x in off],
                "ttft_ms_on_rounds": [x["ttft_ms"] for x in on],
                "outputs_equal": all(x["output"] == y["output"] for x, y in zip(off, on))})
        later = per_request[1:]
        results[name] = {
            "requests": per_request,
            "hit_rate": (sum(x["cached_tokens"] for x in per_request)
                         / sum(x["prompt_tokens"] for x in per_request)),
            # the goal's ratio: the later requests' time to first token over the first's
            "later_over_first_on": (statistics.median(x["ttft_ms_on"] for x in later)
                                    / per_request[0]["ttft_ms_on"]) if later else None,
            "later_on_over_off": (statistics.median(x["ttft_ms_on"] / x["ttft_ms_off"]
                                                    for x in later)) if later else None,
            "outputs_equal": all(x["outputs_equal"] for x in per_request)}
        print(f"{name}: hit rate {results[name]['hit_rate']:.0%}, later/first "
              f"{results[name]['later_over_first_on']:.3f}, outputs equal "
              f"{results[name]['outputs_equal']}", flush=True)
    # the copy itself, on the document's first request, its blocks cached by the last round
    on = engines[True]
    first = workloads["shared document"][0][0]
    ids = on.engine.prompt_ids(on.engine.chat_prompt(first))
    on.chat([first], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    cost = copy_ms(on, ids)
    print(f"copying {cost['positions']} cached positions: {cost['copy_ms']:.1f} ms; storing "
          f"them: {cost['store_ms']:.1f} ms", flush=True)
    data = {"benchmark": "prefix", "title": a.title, "command": "specserve bench " + " ".join(argv),
            "machine": machine(),
            "settings": {"target": a.target, "speculative_config": spec, "dtype": a.dtype,
                         "document_tokens": a.document_tokens, "requests": a.requests,
                         "turns": a.turns, "max_tokens": a.max_tokens, "rounds": a.rounds},
            "workloads": results, "prefix_copy": cost}
    print(report.save(data, a.out, a.publish))
