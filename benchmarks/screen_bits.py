"""How narrow an exact greedy screen of SmolLM2's lm_head can be: over the final states of a
few greedy answers, the columns whose worst-case bound still reaches the row's best, with the
weights rounded to 8, 6, 5 and 4 bits (one scale per column, or per block of 32 inputs). The
bound holds the weights' rounding alone (the inputs' would add to it), so the counts are the
least a screen of that width could keep. Not a test; CI does not run it.

    python benchmarks/screen_bits.py [--max-tokens 60]
"""

from __future__ import annotations

import argparse

import torch

from specserve import LLM, SamplingParams
from specserve.kernels.cpu.binding import QB

PROMPTS = ["Explain how a bicycle works.", "Write a python function that reverses a list."]


def candidates(x: torch.Tensor, w: torch.Tensor, bits: int, blocks: bool) -> torch.Tensor:
    """x [T, in], w [out, in] -> [T]: columns whose upper bound reaches the best lower one."""
    qmax = 2 ** (bits - 1) - 1
    if blocks:
        wb = w.view(w.shape[0], -1, QB)                             # [out, nblk, QB]
        s = wb.abs().amax(2, keepdim=True) / qmax
        wq = ((wb / s).round().clamp(-qmax, qmax) * s).view_as(w)
        err = x.abs() @ s.squeeze(2).repeat_interleave(QB, 1).T / 2  # [T, out]
    else:
        s = w.abs().amax(1, keepdim=True) / qmax                     # [out, 1]
        wq = (w / s).round().clamp(-qmax, qmax) * s
        err = x.abs().sum(1, keepdim=True) * s.T / 2
    approx = x @ wq.T
    assert ((approx - x @ w.T).abs() <= err * 1.0001 + 1e-4).all()  # the bound holds
    return ((approx + err) >= (approx - err).amax(1, keepdim=True)).sum(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=60)
    a = p.parse_args()
    llm = LLM(model="smollm2-135m-instruct", dtype="float32")
    model = llm.engine.model
    rows, greedy = [], model.greedy_logits
    model.greedy_logits = lambda h: rows.append(h.detach().clone()) or greedy(h)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=a.max_tokens),
                 use_tqdm=False)
    x, w = torch.cat(rows), model.embed_tokens.weight.detach().float()   # tied lm_head
    print(f"{x.shape[0]} greedy rows, {w.shape[0]} columns: median candidates (mean, max)\n")
    print("| bits | column scales | block scales (32 inputs) |\n|---:|---:|---:|")
    for bits in (8, 6, 5, 4):
        cells = [candidates(x, w, bits, b).float() for b in (False, True)]
        print(f"| {bits} | " + " | ".join(f"{c.median():.0f} ({c.mean():.0f}, {c.max():.0f})"
                                          for c in cells) + " |")


if __name__ == "__main__":
    main()
