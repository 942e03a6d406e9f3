"""The lm_head's int8 screen for greedy rows (GreedyScreen) on and off, side by side: greedy
decode ms per token of a catalogue target, each configuration in its own process, the
processes alternating for `--rounds` rounds; the tokens must be the same. Not a test; CI does
not run it.

    python benchmarks/screen_ab.py [--target smollm2-135m-instruct] [--dtype bfloat16]
        [--k 0,2 | --rows 1,4] [--rounds 3] [--num-prompts 4] [--max-tokens 96]
        [--baseline DIR]

--k: 0 plain decoding, else the bundled EAGLE-3 head at that K (a verify's rows screened
too). --rows: instead of decoding, the vocabulary projection alone (median of 41 calls) of
that many final hidden states, the last of the first prompt's greedy answer (ms per call;
"same tokens": the argmax of every row). --baseline DIR: a third configuration, screened as
the checkout at DIR has it (its package and kernel: `git worktree add DIR REV`). Prints a
markdown table: medians over rounds of each process's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(a: argparse.Namespace) -> None:
    import torch

    from specserve import LLM, SamplingParams
    from specserve.bench.methods import prompt_set
    from specserve.bench.runners import precision_args
    from specserve.models import cpu_backend
    from specserve.models.metadata import build_metadata
    if not a.on:
        cpu_backend.SCREEN_MIN_VOCAB = 1 << 62
    what, n = a.case.split("=")
    spec = ({"model": f"{a.target}-eagle3", "num_speculative_tokens": int(n)}
            if what == "k" and int(n) else None)
    llm = LLM(a.target, speculative_config=spec, **precision_args(a.dtype))
    prompts = prompt_set("chat", a.num_prompts, a.target)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    if what == "rows":
        model, engine = llm.engine.model, llm.engine
        seq = torch.tensor(first.prompt_token_ids + first.outputs[0].token_ids)
        md, pos = build_metadata([0], [len(seq)], [0], engine.device)
        with torch.inference_mode():
            x = model(seq, pos, md, engine.cache.layers)[-int(n):].contiguous()  # [n, H]
            model.greedy_logits(x)
            times = []
            for _ in range(41):
                t = time.perf_counter()
                y = model.greedy_logits(x)
                times.append(time.perf_counter() - t)
        print(json.dumps({"ms": statistics.median(times) * 1e3, "ids": y.argmax(1).tolist()}))
        return
    ms, ids = [], []
    for p in prompts:
        o = llm.generate(p, params, use_tqdm=False)[0]
        n = len(o.outputs[0].token_ids)
        ids.append(o.outputs[0].token_ids)
        ms.append((o.metrics["finish_time"] - o.metrics["first_token_time"]) / (n - 1) * 1e3)
    print(json.dumps({"ms": statistics.median(ms), "ids": ids}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", default="0,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--baseline", default=None)
    p.add_argument("--rows", default=None)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case is not None:
        return child(a)
    base = [sys.executable, __file__, "--target", a.target, "--dtype", a.dtype,
            "--num-prompts", str(a.num_prompts), "--max-tokens", str(a.max_tokens)]
    configs = ["full", "screened"] + (["baseline"] if a.baseline else [])
    cases = ([f"rows={n}" for n in a.rows.split(",")] if a.rows
             else [f"k={k}" for k in a.k.split(",")])
    times: dict[tuple[str, str], list[float]] = {}
    ids: dict[str, set[str]] = {}
    for r in range(a.rounds):
        for k in cases:
            for c in (configs if r % 2 == 0 else configs[::-1]):
                env = os.environ | ({"PYTHONPATH": os.path.abspath(a.baseline)}
                                    if c == "baseline" else {})
                out = subprocess.run(base + ["--case", k] + (["--on"] * (c != "full")),
                                     capture_output=True, text=True, check=True, env=env).stdout
                res = json.loads(out.strip().splitlines()[-1])
                times.setdefault((k, c), []).append(res["ms"])
                ids.setdefault(k, set()).add(json.dumps(res["ids"]))
    print(f"{a.target}, {a.dtype}, {a.num_prompts} held-out chat prompts x {a.max_tokens} "
          f"tokens, greedy, medians of {a.rounds} alternating rounds"
          + (f"; baseline: screened at {a.baseline}" if a.baseline else "") + "\n")
    unit = "ms/call" if a.rows else "ms/token"
    print("| configuration | " + " | ".join(f"{c} {unit}" for c in configs)
          + " | full / screened | same tokens |")
    print("|---|" + "---:|" * (len(configs) + 2))
    for k in cases:
        med = {c: statistics.median(times[k, c]) for c in configs}
        what, n = k.split("=")
        name = (f"lm_head, {n} row{'s' * (n != '1')}" if what == "rows"
                else "plain" if n == "0" else f"EAGLE-3 head, K={n}")
        cells = " | ".join(f"{med[c]:.2f} ({min(times[k, c]):.2f}-{max(times[k, c]):.2f})"
                           for c in configs)
        print(f"| {name} | {cells} | {med['full'] / med['screened']:.2f}x "
              f"| {'yes' if len(ids[k]) == 1 else 'NO'} |")


if __name__ == "__main__":
    main()
