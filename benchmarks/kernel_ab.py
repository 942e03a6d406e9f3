"""Two versions of the CPU kernel side by side: SmolLM2's forward (the layers' one C call) at
each context and row count, in alternating processes (one kernel build each), medians over the
rounds. Not a test; CI does not run it.

    git show REV:specserve/kernels/cpu/kernel.c > runs/kernel-before.c
    python benchmarks/kernel_ab.py runs/kernel-before.c [--after specserve/kernels/cpu/kernel.c]
        [--dtype bfloat16,int8] [--contexts 128,1024] [--rows 1,5] [--rounds 3]

`CFLAGS=-mno-avx512f` compares the AVX2 builds. `--attention` times the attention alone: a
random-weight model of SmolLM2's attention (30 layers, 9 query and 3 KV heads of 64) with an MLP
64 wide, its forward at each context less its forward at context 8 (the two alternating), so
that the products' swings on a noisy VM stay out of the difference (it holds 1,024 positions:
e.g. `--contexts 256,1016`). `--bits` times nothing: it checks that the two kernels give SmolLM2
the same outputs bit for bit (a 700-token prefill, then steps of 5, 1, 3 and 7 rows, in each
`--dtype`), for a change meant to keep every sum as it was.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# SmolLM2's attention with next to no MLP or vocabulary (--attention)
ATTENTION_MODEL = "random:hidden=576,layers=30,inter=64,heads=9,kv=3,head_dim=64,vocab=1024"
SHORT = 8               # --attention: the context whose forward is taken off
BITS_STEPS = ((0, 700), (700, 5), (705, 1), (706, 3), (709, 7))   # (context, rows)


def engines(source: str, target: str, dtypes: list[str], max_len: int):
    """(precision, engine) of `target` in each of `dtypes`, on the kernel built from `source`."""
    from specserve.kernels.cpu import binding
    binding.SOURCE = Path(source).resolve()         # before the engine loads the library
    from specserve import LLM
    from specserve.bench.runners import precision_args
    for dt in dtypes:
        yield dt, LLM(target, max_num_seqs=1, max_model_len=max_len, **precision_args(dt)).engine


def outputs(source: str, dtypes: list[str], path: str) -> None:
    """SmolLM2's forward outputs of BITS_STEPS with the kernel built from `source`, saved to
    `path` (safetensors), keyed "<dtype> <context> <rows>"."""
    import torch
    from safetensors.torch import save_file

    from specserve.models.metadata import build_metadata

    out = {}
    for dt, engine in engines(source, "smollm2-135m-instruct", dtypes, 2048):
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for ctx, n in BITS_STEPS:
                ids = torch.randint(0, engine.model.args.vocab_size, (n,), generator=g)
                md, pos = build_metadata([ctx], [n], [0], engine.device)
                out[f"{dt} {ctx} {n}"] = engine.model(ids, pos, md, engine.cache.layers).clone()
    save_file(out, path)


def same_bits(before: str, after: str, dtype: str) -> None:
    """Print, per step, whether the two kernels' outputs are equal bit for bit."""
    import tempfile

    import torch
    from safetensors.torch import load_file
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, src in enumerate((before, after)):
            files.append(f"{tmp}/{i}.safetensors")
            subprocess.run([sys.executable, __file__, src, "--measure", "--bits", "--dtype", dtype,
                            "--out", files[-1]], check=True, capture_output=True)
        a, b = (load_file(f) for f in files)
    print("| step (precision, context, rows) | equal bit for bit | largest difference |\n"
          "|---|---|---:|")
    for key in a:
        print(f"| {key} | {'yes' if torch.equal(a[key], b[key]) else 'NO'} | "
              f"{(a[key] - b[key]).abs().max().item():.3g} |")


def measure(source: str, dtypes: list[str], contexts: list[int], rows: list[int],
            repeats: int, attention: bool = False) -> dict[str, float]:
    """Forward ms of each (precision, context, rows) with the kernel built from `source` (with
    `attention`: ATTENTION_MODEL's forward less its forward at context SHORT)."""
    import torch

    from specserve.bench.random_models import materialize
    from specserve.models.metadata import build_metadata
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_split import _median_ms

    target = (materialize(ATTENTION_MODEL, REPO / "models" / "code-target") if attention
              else "smollm2-135m-instruct")
    out = {}
    # ATTENTION_MODEL holds 1,024 positions
    for dt, engine in engines(source, target, dtypes, 1024 if attention else 2048):
        def forward(ctx: int, n: int, e=engine):
            ids = torch.arange(10, 10 + n)
            md, pos = build_metadata([ctx], [n], [0], e.device)
            return lambda: e.model(ids, pos, md, e.cache.layers)
        with torch.inference_mode():
            for ctx in contexts:
                for n in rows:
                    key = f"{dt}, context {ctx}, {n} rows"
                    if not attention:
                        out[key] = _median_ms(forward(ctx, n), repeats)
                        continue
                    long, short = forward(ctx, n), forward(SHORT, n)
                    pairs = [(_median_ms(long, 1), _median_ms(short, 1)) for _ in range(repeats)]
                    out[key] = statistics.median(a - b for a, b in pairs)
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
    p.add_argument("--attention", action="store_true",
                   help="the attention alone (see above), not SmolLM2's forward")
    p.add_argument("--bits", action="store_true",
                   help="compare the two kernels' outputs bit for bit instead of timing them")
    p.add_argument("--out", help=argparse.SUPPRESS)           # --measure --bits: where to save
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    dtypes, contexts, rows = (a.dtype.split(","), [int(c) for c in a.contexts.split(",")],
                              [int(r) for r in a.rows.split(",")])
    if a.measure and a.bits:
        outputs(a.before, dtypes, a.out)
        return
    if a.bits:
        same_bits(a.before, a.after, a.dtype)
        return
    if a.measure:                                   # one process, one kernel: `before`
        print(json.dumps(measure(a.before, dtypes, contexts, rows, a.repeats, a.attention)))
        return
    times: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(a.rounds):
        for side, src in (("before", a.before), ("after", a.after)):
            done = subprocess.run([sys.executable, __file__, src, "--measure", "--dtype", a.dtype,
                                   "--contexts", a.contexts, "--rows", a.rows, "--repeats",
                                   str(a.repeats)] + ["--attention"] * a.attention,
                                  capture_output=True, text=True, check=True)
            times[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    what = f"attention ms (forward less its forward at context {SHORT})" if a.attention else \
        "forward ms"
    print(f"{what}, medians of {a.rounds} alternating processes\n\n"
          "| | before | after |\n|---|---:|---:|")
    for key in times["before"][0]:
        b, f = (statistics.median(r[key] for r in times[s]) for s in ("before", "after"))
        print(f"| {key} | {b:.2f} | {f:.2f} |")


if __name__ == "__main__":
    main()
