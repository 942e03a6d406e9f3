"""Every SmolLM2 drafter's greedy output against no-spec's, in the precisions the tests do not
run (they check float32): bfloat16, int8 and the GGUF's own q4_1, one request at a time and the
prompts batched together. A drafter is lossless when every count equals the number of prompts.
Not a test (minutes per precision); a check to run after a change to the kernel or the engine.

    python benchmarks/lossless_sweep.py [--precisions bfloat16,int8,q4_1] [--num-prompts 3]
"""

from __future__ import annotations

import argparse

from specserve import LLM, SamplingParams
from specserve.bench.methods import prompt_set

TARGET = "smollm2-135m-instruct"
TREE = "[(0,), (0, 0), (0, 0, 0), (1,), (0, 1), (1, 0)]"


def drafters() -> dict[str, dict]:
    def zoo(method: str, name: str | None = None, **extra) -> dict:
        return {"method": method, "model": f"{TARGET}-{name or method}"} | extra
    return {
        "ngram K=4": {"method": "ngram", "num_speculative_tokens": 4},
        "suffix": {"method": "suffix"},
        "auto": {"method": "auto"},
        "eagle3 K=3": zoo("eagle3", num_speculative_tokens=3),
        "eagle3 K=3, lookup first": zoo("eagle3", num_speculative_tokens=3,
                                        hybrid_prompt_lookup=3),
        "eagle3 tree": zoo("eagle3", speculative_token_tree=TREE),
        "P-EAGLE K=2": zoo("eagle3", "peagle", num_speculative_tokens=2, parallel_drafting=True),
        "eagle K=2": zoo("eagle", num_speculative_tokens=2),
        "eagle tree": zoo("eagle", speculative_token_tree=TREE),
        "medusa": zoo("medusa"),
        "mtp K=1": zoo("mtp", num_speculative_tokens=1),
        "dflash K=3": zoo("dflash", num_speculative_tokens=3),
        "mlp_speculator": zoo("mlp_speculator"),
        "draft_model K=2": zoo("draft_model", num_speculative_tokens=2),
        "PARD K=3": zoo("draft_model", "pard", num_speculative_tokens=3, parallel_drafting=True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="bfloat16,int8,q4_1")
    p.add_argument("--num-prompts", type=int, default=3, help="of chat and of code each")
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    prompts = (prompt_set("chat", a.num_prompts, TARGET)
               + prompt_set("code", a.num_prompts, TARGET))
    greedy = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    n = len(prompts)
    for precision in a.precisions.split(","):
        quant = {} if precision == "bfloat16" else {"quantization": precision}
        ref = [o.outputs[0].token_ids for o in LLM(TARGET, dtype="bfloat16", **quant).generate(
            prompts, greedy, use_tqdm=False)]
        for name, spec in drafters().items():
            llm = LLM(TARGET, dtype="bfloat16", speculative_config=spec, **quant)
            alone = [llm.generate([x], greedy, use_tqdm=False)[0].outputs[0].token_ids
                     for x in prompts]
            together = [o.outputs[0].token_ids
                        for o in llm.generate(prompts, greedy, use_tqdm=False)]
            equal = [sum(list(x) == list(y) for x, y in zip(ref, got)) for got in (alone, together)]
            print(f"{precision:9} {name:26} equal alone {equal[0]}/{n}, batched {equal[1]}/{n}",
                  flush=True)


if __name__ == "__main__":
    main()
