"""Held-out chat tau of trained heads at one K, greedy and at temperature 0.7, as a head's
`quality.json` measures it (16 held-out chat prompts x 128 tokens through the chat template):
for heads trained without --eval-chat, or compared after the fact. Not a test.

    python benchmarks/head_tau.py [--target smollm2-135m-instruct] [--method eagle3] [-k 4]
        [--pool base] [--num-prompts 16] [--temperatures 0,0.7] DIR...
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.data.chat_prompts import POOLS
from specserve.models.catalogue import resolve_model
from specserve.train.heads import evaluate_tau


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("heads", nargs="+", help="head directories")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--method", default="eagle3")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--pool", choices=POOLS, default="base",
                   help="whose held-out chat prompts (data/chat_prompts.py)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="held-out prompts (quality.json measures 16; more: less noise)")
    p.add_argument("--temperatures", default="0,0.7")
    a = p.parse_args()
    target = Path(resolve_model(a.target))
    for d in a.heads:
        for t in map(float, a.temperatures.split(",")):
            r = evaluate_tau(target, Path(d), a.method, a.k, a.num_prompts, 128, None, True, t,
                             a.pool)
            print(f"{d}  {a.pool} x {a.num_prompts}  K={a.k}  temperature {t}: tau "
                  f"{r['tau']:.3f}, per position "
                  + ", ".join(f"{x:.3f}" for x in r["per_position"]), flush=True)


if __name__ == "__main__":
    main()
