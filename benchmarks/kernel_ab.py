"""Two versions of the CPU kernel side by side: SmolLM2's forward (the layers' one C call) at
each context and row count, in alternating processes (one kernel build each), medians over the
rounds. Not a test; CI does not run it.

    git show REV:specserve/kernels/cpu/kernel.c > runs/kernel-before.c
    python benchmarks/kernel_ab.py runs/kernel-before.c [--after specserve/kernels/cpu/kernel.c]
        [--dtype bfloat16,int8] [--contexts 128,1024] [--rows 1,5] [--rounds 3]

`CFLAGS=-mno-avx512f` compares the AVX2 builds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(source: str, dtypes: list[str], contexts: list[int], rows: list[int],
            repeats: int) -> dict[str, float]:
    """Forward ms of each (precision, context, rows) with the kernel built from `source`."""
    import torch

    from specserve.kernels.cpu import binding
    binding.SOURCE = Path(source).resolve()         # before the engine loads the library
    from specserve import LLM
    from specserve.bench.runners import precision_args
    from specserve.models.metadata import build_metadata
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_split import _median_ms

    out = {}
    for dt in dtypes:
        engine = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=2048,
                     **precision_args(dt)).engine
        with torch.inference_mode():
            for ctx in contexts:
                for n in rows:
                    ids = torch.arange(10, 10 + n)
                    md, pos = build_metadata([ctx], [n], [0], engine.device)
                    out[f"{dt}, context {ctx}, {n} rows"] = _median_ms(
                        lambda e=engine, i=ids, ps=pos, m=md: e.model(i, ps, m, e.cache.layers),
                        repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="a kernel.c to compare")
    p.add_argument("--after", default=str(REPO / "specserve/kernels/cpu/kernel.c"))
    p.add_argument("--dtype", default="bfloat16,int8")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--rows", default="1,5")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    dtypes, contexts, rows = (a.dtype.split(","), [int(c) for c in a.contexts.split(",")],
                              [int(r) for r in a.rows.split(",")])
    if a.measure:                                   # one process, one kernel: `before`
        print(json.dumps(measure(a.before, dtypes, contexts, rows, a.repeats)))
        return
    times: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(a.rounds):
        for side, src in (("before", a.before), ("after", a.after)):
            done = subprocess.run([sys.executable, __file__, src, "--measure", "--dtype", a.dtype,
                                   "--contexts", a.contexts, "--rows", a.rows, "--repeats",
                                   str(a.repeats)], capture_output=True, text=True, check=True)
            times[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"forward ms, medians of {a.rounds} alternating processes\n\n"
          "| | before | after |\n|---|---:|---:|")
    for key in times["before"][0]:
        b, f = (statistics.median(r[key] for r in times[s]) for s in ("before", "after"))
        print(f"| {key} | {b:.2f} | {f:.2f} |")


if __name__ == "__main__":
    main()
