"""The lm_head's int8 screen for greedy rows (GreedyScreen) on and off, side by side: greedy
decode ms per token of a catalogue target, each configuration in its own process, the
processes alternating for `--rounds` rounds; the tokens must be the same. Not a test; CI does
not run it.

    python benchmarks/screen_ab.py [--target smollm2-135m-instruct] [--dtype bfloat16]
        [--k 0,2] [--rounds 3] [--num-prompts 4] [--max-tokens 96]

--k: 0 plain decoding, else the bundled EAGLE-3 head at that K (a verify's rows screened
too). Prints a markdown table: medians over rounds of each process's median over prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def child(a: argparse.Namespace) -> None:
    from specserve import LLM, SamplingParams
    from specserve.bench.methods import prompt_set
    from specserve.bench.runners import precision_args
    from specserve.models import cpu_backend
    if not a.on:
        cpu_backend.SCREEN_MIN_VOCAB = 1 << 62
    spec = ({"model": f"{a.target}-eagle3", "num_speculative_tokens": a.child_k}
            if a.child_k else None)
    llm = LLM(a.target, speculative_config=spec, **precision_args(a.dtype))
    prompts = prompt_set("chat", a.num_prompts, a.target)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)
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
    p.add_argument("--child-k", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_k is not None:
        return child(a)
    base = [sys.executable, __file__, "--target", a.target, "--dtype", a.dtype,
            "--num-prompts", str(a.num_prompts), "--max-tokens", str(a.max_tokens)]
    times: dict[tuple[int, bool], list[float]] = {}
    ids: dict[int, set[str]] = {}
    for r in range(a.rounds):
        for k in (int(k) for k in a.k.split(",")):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                out = subprocess.run(base + ["--child-k", str(k)] + (["--on"] if on else []),
                                     capture_output=True, text=True, check=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                times.setdefault((k, on), []).append(res["ms"])
                ids.setdefault(k, set()).add(json.dumps(res["ids"]))
    print(f"{a.target}, {a.dtype}, {a.num_prompts} held-out chat prompts x {a.max_tokens} "
          f"tokens, greedy, medians of {a.rounds} alternating rounds\n")
    print("| configuration | full lm_head ms/token | screened ms/token | ratio | same tokens |")
    print("|---|---:|---:|---:|---:|")
    for k in sorted(ids):
        off, on = statistics.median(times[k, False]), statistics.median(times[k, True])
        name = "plain" if k == 0 else f"EAGLE-3 head, K={k}"
        print(f"| {name} | {off:.2f} ({min(times[k, False]):.2f}-{max(times[k, False]):.2f}) "
              f"| {on:.2f} ({min(times[k, True]):.2f}-{max(times[k, True]):.2f}) "
              f"| {off / on:.2f}x | {'yes' if len(ids[k]) == 1 else 'NO'} |")


if __name__ == "__main__":
    main()
