"""`specserve zoo eval`: the quality figures of the bundled models.

- bits per byte on the held-out corpus files;
- the share of distinct 4-grams in the target's greedy 128-token completions of code prompts
  (a degenerate model loops and scores low);
- how sure the target is of its own greedy tokens there (the probability of each, its top-1):
  a drafter's greedy token must match the target's top-1, which is hard where that probability
  is low and the runner-up is close, so this bounds the acceptance any drafter reaches;
- batch-1 decode step cost of target and draft in specserve, measured side by side.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from specserve.data.prompts import completion_prompts
from specserve.inputs import TokensPrompt
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.train.lm import measure_bpb


def distinct_4gram_share(tokens: list[int]) -> float:
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def greedy_completions(model_dir: str, prompts: list[str], max_tokens: int = 128):
    llm = LLM(model_dir, device="cpu")
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True, logprobs=0), use_tqdm=False)


def greedy_top1_probs(outs) -> list[float]:
    """The probability the model gave each token of its greedy completions `outs` (from
    `greedy_completions`): its top-1 probability there."""
    return [math.exp(lp[t]) for o in outs
            for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]


def step_ms(model_dir: str, tokens: int = 128, repeats: int = 3) -> float:
    """Median batch-1 greedy decode time per token (prompt included)."""
    llm = LLM(model_dir, device="cpu")
    prompt = TokensPrompt(prompt_token_ids=list(range(10, 74)))

    def seconds(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t
    seconds(8)                                  # warm-up
    return statistics.median(seconds(tokens) / tokens * 1e3 for _ in range(repeats))


def zoo_report(models: str = "models", results: str | None = None) -> dict:
    target, draft = f"{models}/code-target", f"{models}/code-draft"
    outs = greedy_completions(target, completion_prompts(8))
    shares = [distinct_4gram_share(o.outputs[0].token_ids) for o in outs]
    top1 = greedy_top1_probs(outs)
    report = {
        "target_val_bits_per_byte": round(measure_bpb(Path(target)), 4),
        "target_val_bits_per_byte_int8": round(measure_bpb(Path(target), quantization="int8"), 4),
        "draft_val_bits_per_byte": round(measure_bpb(Path(draft)), 4),
        "target_distinct_4gram_share_min": round(min(shares), 3),
        "target_distinct_4gram_share_mean": round(sum(shares) / len(shares), 3),
        "target_greedy_top1_prob_median": round(statistics.median(top1), 3),
        "target_greedy_top1_prob_below_half": round(sum(p < 0.5 for p in top1) / len(top1), 3),
    }
    t_ms, d_ms = step_ms(target), step_ms(draft)
    report |= {"target_ms_per_token": round(t_ms, 2), "draft_ms_per_token": round(d_ms, 2),
               "target_over_draft_step_cost": round(t_ms / d_ms, 2),
               "sample_completion": outs[0].prompt + outs[0].outputs[0].text}
    print(json.dumps(report, indent=2))
    if results:
        import datetime
        import platform
        sample = report["sample_completion"].replace("\n", "\n    ")
        rows = "\n".join(f"| {k} | {v} |" for k, v in report.items() if k != "sample_completion")
        with open(results, "a") as f:
            f.write(f"\n## Model zoo quality\n\n- date: {datetime.date.today().isoformat()}; "
                    f"machine: {platform.machine()} CPU; command: `specserve zoo eval "
                    f"--results {results}`\n- bits/byte on the held-out stdlib files; distinct "
                    "4-gram share of greedy 128-token completions of 8 held-out code prompts; "
                    "the target's probability of its own greedy tokens there (top-1); "
                    "batch-1 greedy decode ms/token in specserve (float32)\n\n"
                    f"| measure | value |\n|---|---|\n{rows}\n\nFirst greedy completion:\n\n"
                    f"    {sample}\n")
    return report
