"""Offline speculative decoding with each method on the bundled zoo, like vLLM's example.

    python examples/offline_spec_decode.py --method draft_model --num-spec-tokens 4
"""

from __future__ import annotations

import argparse
import time

from specserve import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef list_python_files(root):\n",
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/code-target")
    p.add_argument("--method", default="draft_model", choices=["none", "ngram", "suffix",
                                                                "draft_model"])
    p.add_argument("--draft", default="models/code-draft")
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args()
    spec = None
    if a.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": a.num_spec_tokens,
                "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    elif a.method == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": a.num_spec_tokens}
    elif a.method == "draft_model":
        spec = {"method": "draft_model", "model": a.draft,
                "num_speculative_tokens": a.num_spec_tokens}
    llm = LLM(a.model, speculative_config=spec, device="cpu", dtype="float32")
    t = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=a.max_tokens))
    dt = time.perf_counter() - t
    for o in outs:
        print("-" * 60)
        print(o.prompt + o.outputs[0].text)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("-" * 60)
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s)")
    if spec:            # read as vLLM's example reads them
        num_drafts = num_draft_tokens = num_accepted = 0
        per_pos: list[int] = []
        for metric in llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                num_drafts = metric.value
            elif metric.name == "vllm:spec_decode_num_draft_tokens":
                num_draft_tokens = metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                num_accepted = metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_pos = metric.values
        print(f"mean acceptance length {1 + num_accepted / max(1, num_drafts):.2f}, acceptance "
              f"rate {num_accepted / max(1, num_draft_tokens):.1%}")
        print("per-position acceptance: "
              + ", ".join(f"{x / max(1, num_drafts):.2f}" for x in per_pos))


if __name__ == "__main__":
    main()
