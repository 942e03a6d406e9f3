"""Greedy batch-1 decoding of SmolLM2 in a loop for a set time, for a sampling profiler to
attach to (prints READY, then ms a token at the end). Not a benchmark of its own:

    python benchmarks/decode_loop.py --quantization int8 --seconds 12 &
    sleep 12; perf record -e cpu-clock -F 4000 -p $! -o runs/perf.data -- sleep 8
    perf report -i runs/perf.data --sort dso,symbol --stdio
"""

from __future__ import annotations

import argparse
import time

from specserve import LLM, SamplingParams, TokensPrompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default=None, help="int8, q4_1, ... (default: bfloat16)")
    p.add_argument("--seconds", type=float, default=12.0)
    a = p.parse_args()
    llm = LLM(a.target, dtype="bfloat16", device="cpu", seed=0, quantization=a.quantization)
    prompt = TokensPrompt(prompt_token_ids=list(range(10, 138)))        # context 128 to 256
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    print("READY", flush=True)
    start, tokens = time.perf_counter(), 0
    while time.perf_counter() - start < a.seconds:
        llm.generate(prompt, params, use_tqdm=False)
        tokens += params.max_tokens
    print(f"{(time.perf_counter() - start) / tokens * 1e3:.2f} ms a token", flush=True)


if __name__ == "__main__":
    main()
