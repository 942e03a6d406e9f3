"""What a verify row costs on this CPU: the kernel's products of SmolLM2's layer shapes for 1,
2, 4, 5 and 8 rows, once with the weights streaming from memory (30 layers, as a step runs
them) and once from cache (one layer over and over). Not a test; CI does not run it.

    python benchmarks/product_rate.py [--dtype bfloat16,int8,q4_1,q8_0] [--rows 1,2,4,5,8]
        [--repeats 9] [--publish]

Rows are free while the products of n rows take less time than the weights take to stream:
the "from cache" rate (products a second with no memory stall) against the "from memory" one
tells how many rows a CPU multiplies for the price of one. Each figure is the median of
`--repeats` timings, less what as many calls of a 64 x 64 product cost from Python. Random
weights of SmolLM2's shapes (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536).
Writes runs/product_rate/; with --publish benchmarks/latest/product-rate-<cpu>[-avx2].* and
a line in benchmarks/HISTORY.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from specserve.bench.probes import machine, memory_bandwidth_gbs
from specserve.kernels.cpu import binding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_split import _median_ms, kernel_header, save  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]        # one layer's (out, in)
LAYERS = 30


def pack(w: torch.Tensor, dtype: str, block: int) -> torch.Tensor:
    if dtype == "bfloat16":
        return binding.pack_weight(w.to(torch.bfloat16), block, pairs=True)
    return binding.pack_weight(w, block, quantization=dtype)


def measure(dtype: str, rows: list[int], repeats: int, lib) -> list[dict]:
    block = lib.specserve_block()
    gen = torch.Generator().manual_seed(0)
    weights = [pack(torch.randn(o, i, generator=gen) * 0.05, dtype, block)
               for _ in range(LAYERS) for o, i in SHAPES]
    nbytes = sum(w.nbytes for w in weights)
    macs = LAYERS * sum(o * i for o, i in SHAPES)                   # per row
    tiny = binding.pack_weight(torch.randn(64, 64), block)
    out = []
    for n in rows:
        xs = {i: torch.randn(n, i, generator=gen) for _, i in SHAPES}
        x64 = torch.randn(n, 64, generator=gen)

        def run(ws):
            return lambda: [binding.linear_rows(lib, xs[i], w, None, o)
                            for w, (o, i) in zip(ws, SHAPES * LAYERS)]

        calls = _median_ms(lambda: [binding.linear_rows(lib, x64, tiny, None, 64)
                                   for _ in weights], repeats)
        memory = _median_ms(run(weights), repeats) - calls
        cache = _median_ms(run(weights[:len(SHAPES)] * LAYERS), repeats) - calls
        out.append({"dtype": dtype, "rows": n, "memory_ms": memory, "cache_ms": cache,
                    "weight_bytes": nbytes, "gb_per_s": nbytes / memory / 1e6,
                    "cache_gmacs": macs * n / cache / 1e6})
        print(json.dumps(out[-1]), flush=True)
    return out


def markdown(data: dict) -> str:
    lines = kernel_header(data) + [
             "- ms for SmolLM2's 120 layer products, medians; from memory: 30 layers' weights "
             "(the step); from cache: one layer's, 30 times; x one row: from memory", "",
             "| precision | rows | from memory (x one row) | GB/s | from cache | products/s "
             "from cache |", "|---|---:|---:|---:|---:|---:|"]
    one = {r["dtype"]: r["memory_ms"] for r in data["rows"] if r["rows"] == 1}
    for r in data["rows"]:
        ratio = f" ({r['memory_ms'] / one[r['dtype']]:.2f}x)" if r["dtype"] in one else ""
        lines.append(f"| {r['dtype']} | {r['rows']} | {r['memory_ms']:.2f}{ratio} | "
                     f"{r['gb_per_s']:.1f} | {r['cache_ms']:.2f} | "
                     f"{r['cache_gmacs']:.0f} G |")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Per precision: the products' time from memory and from cache against rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, dtype in enumerate(dict.fromkeys(r["dtype"] for r in data["rows"])):
        rows = [r for r in data["rows"] if r["dtype"] == dtype]
        n = [r["rows"] for r in rows]
        ax.plot(n, [r["memory_ms"] for r in rows], "o-", color=f"C{i}",
                label=f"{dtype}, from memory")
        ax.plot(n, [r["cache_ms"] for r in rows], "o--", color=f"C{i}",
                label=f"{dtype}, from cache")
    ax.set(xlabel="rows", ylabel="ms for the 120 layer products",
           title=f"{data['title']} ({data['machine']['date']})")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16,int8,q4_1,q8_0")
    p.add_argument("--rows", default="1,2,4,5,8")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--publish", action="store_true")
    a = p.parse_args()
    lib = binding.load_library()
    if lib is None:
        raise SystemExit("the CPU kernel could not be built: nothing to measure")
    rows_list = [int(r) for r in a.rows.split(",")]
    bw = memory_bandwidth_gbs()
    rows = [r for dtype in a.dtype.split(",") for r in measure(dtype, rows_list, a.repeats, lib)]
    kernel = binding.cpu_features(lib)
    data = {"benchmark": "product-rate", "title": "The kernel's products: rows from memory "
            "and from cache", "command": "python benchmarks/product_rate.py "
            + " ".join(sys.argv[1:]), "machine": machine(), "kernel": kernel,
            "bandwidth_gbs": max(bw, memory_bandwidth_gbs()), "rows": rows}
    five = {r["dtype"]: r for r in rows if r["rows"] == 5}
    one = {r["dtype"]: r for r in rows if r["rows"] == 1}
    parts = [f"{d} 5 rows {five[d]['memory_ms'] / one[d]['memory_ms']:.2f}x one"
             for d in five if d in one]
    summary = " · " + ", ".join(parts) if parts else ""
    cpu = re.sub(r"[^a-z0-9]+", "-", data["machine"]["cpu"].lower()).strip("-")
    save(data, markdown(data), f"product-rate-{cpu}", a.publish, summary, plot)


if __name__ == "__main__":
    main()
