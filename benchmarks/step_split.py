"""Where a CPU decode step's time goes: a model's step on the kernel taken apart, beside the
bandwidth floor of each part. Not a test; CI does not run it.

    python benchmarks/step_split.py [--target smollm2-135m-instruct]
        [--dtype bfloat16,int8,q4_1] [--contexts 128,1024] [--rows 1,5] [--publish]

Per precision, context and rows (1: a decode; 5: the verify of 4 drafts), medians of
`--repeats` interleaved timings:
- forward: the layers' one C call (embedding, 30 layers, final norm) on `rows` new tokens
  after `context` cached ones;
- linears: every layer's four packed products (qkv, o, gate_up, down) on inputs of `rows`
  rows, layer after layer as the step runs them (so each layer's weights come from memory,
  not a warm cache), less what as many calls of a 64 x 64 product cost from Python;
- attention and the rest = forward - linears (attention over the context, RMSNorms, rotary,
  SiLU, residuals, the call's threading);
- lm_head: the vocabulary projection of the `rows` final states, as a greedy step runs it
  (through its int8 screen where it has one: GreedyScreen);
- engine: with rows 1 at the decode probe's context, a whole decode step through
  `LLM.generate` (prompt left out) minus forward and lm_head: scheduling, sampling, Python.
The floor of a part is the bytes of its weights over the memory bandwidth measured in the same
run; beside the decode step, the time to read its weights alone where they lie and the step's
ratio to it (`decode_against_read`). `CFLAGS=-mno-avx512f` builds the kernel for AVX2 (the
`kernel` field says which build ran). Writes runs/step_split/; with --publish benchmarks/latest/step-split-<target>[-avx2].*
and a line in benchmarks/HISTORY.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specserve import LLM
from specserve.bench.probes import decode_against_read, machine, memory_bandwidth_gbs
from specserve.bench.runners import precision_args
from specserve.kernels.cpu import binding
from specserve.models.metadata import build_metadata

REPO = Path(__file__).resolve().parents[1]
DECODE_CONTEXT = 128        # decode_against_read: a 64-token prompt and 128 new tokens


def _linears(model) -> list:
    return [lin for layer in model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _median_ms(fn, repeats: int) -> float:
    fn()                                                          # warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def split(llm: LLM, context: int, rows: int, repeats: int) -> dict[str, float]:
    """The parts' times in ms for one step of `rows` rows after `context` tokens."""
    engine = llm.engine
    model = engine.model
    lib = binding.load_library()
    ids = torch.arange(10, 10 + rows)
    md, pos = build_metadata([context], [rows], [0], engine.device)
    hidden = model(ids, pos, md, engine.cache.layers)
    linears = _linears(model)
    inputs = {lin.in_features: torch.randn(rows, lin.in_features) for lin in linears}

    # what a call from Python costs beyond its product (ctypes, the output tensor), measured
    # on a product of nothing: taken off the linears, which the forward calls from C
    tiny = binding.pack_weight(torch.randn(64, 64), lib.specserve_block())       # float32
    x_tiny = torch.randn(rows, 64)

    def products(weights: list[tuple[torch.Tensor, torch.Tensor, int]]):
        return lambda: [binding.linear_rows(lib, x, w, None, n) for x, w, n in weights]

    real = [(inputs[lin.in_features], lin.kernel_weight, lin.out_features) for lin in linears]
    calls = _median_ms(products([(x_tiny, tiny, 64)] * len(linears)), repeats)
    out = {"forward": _median_ms(lambda: model(ids, pos, md, engine.cache.layers), repeats),
           "linears": _median_ms(products(real), repeats) - calls,
           # as a greedy step takes it: through the lm_head's int8 screen where it has one
           "lm_head": _median_ms(lambda: model.greedy_logits(hidden), repeats)}
    out["attention and the rest"] = out["forward"] - out["linears"]
    return out


def weight_bytes(model) -> dict[str, int]:
    screen = model.lm_head.screen
    return {"linears": sum(lin.kernel_weight.nbytes for lin in _linears(model)),
            "lm_head": model.lm_head.kernel_weight.nbytes if screen is None else screen.nbytes}


def kernel_header(data: dict) -> list[str]:
    """A kernel run's title, machine, build, bandwidth and command lines."""
    m = data["machine"]
    return [f"## {data['title']}", "",
            f"- {m['date']}, commit {m['commit']}; {m['cpu']} ({m['cpus']} CPUs), kernel "
            f"built for {data['kernel']}; memory bandwidth {data['bandwidth_gbs']:.1f} GB/s",
            f"- command: `{data['command']}`"]


def save(data: dict, table: str, name: str, publish: bool, summary: str,
         plot: Callable[[dict, Path], None] | None = None) -> None:
    """The run's JSON and table (and `plot`'s figure, where given) to runs/<benchmark>/ (and
    printed); with `publish` also to benchmarks/latest/<name>[-avx2] and a line in HISTORY.md
    ending in `summary`."""
    out = REPO / "runs" / data["benchmark"].replace("-", "_")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{data['benchmark']}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table + "\n")
    if plot:
        plot(data, out / f"{stem}.png")
    print(table)
    if not publish:
        return
    latest = REPO / "benchmarks" / "latest" / (
        name + ("-avx2" if data["kernel"].startswith("AVX2") else ""))
    latest.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    latest.with_suffix(".md").write_text(table + "\n")
    if plot:
        plot(data, latest.with_suffix(".png"))
    with (REPO / "benchmarks" / "HISTORY.md").open("a") as f:
        f.write(f"- {data['machine']['date']} · {data['machine']['commit']} · "
                f"{data['title']} ({data['kernel']}) · `{data['command']}`{summary}\n")


def markdown(data: dict) -> str:
    lines = kernel_header(data) + [
             "- ms, medians; floor = the part's weight bytes / bandwidth; attention and the rest "
             "= forward - linears; engine = the whole decode step - forward - lm_head; weights "
             "read = the time to read the weights alone (no arithmetic), decode / read the "
             "median of the decode's timings each over the reads around it", "",
             "| precision | context | rows | forward | linears (floor) | attention and the rest "
             "| lm_head (floor) | step | engine | decode step (floor) | weights read "
             "| decode / read |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        fl = r["floor_ms"]
        step = r["forward"] + r["lm_head"]
        engine = f"{r['engine']:.2f}" if "engine" in r else ""
        decode = (f"{r['decode_step']:.2f} ({fl['linears'] + fl['lm_head']:.2f})"
                  if "decode_step" in r else "")
        read = (f"{r['weights_read']:.2f} | {r['decode_over_read']:.2f}x"
                if r.get("weights_read") is not None else " |")
        lines.append(f"| {r['dtype']} | {r['context']} | {r['rows']} | {r['forward']:.2f} | "
                     f"{r['linears']:.2f} ({fl['linears']:.2f}) | "
                     f"{r['attention and the rest']:.2f} | {r['lm_head']:.2f} "
                     f"({fl['lm_head']:.2f}) | {step:.2f} | {engine} | {decode} | {read} |")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Each measured step as stacked parts (ms), its weight-bytes floor marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = data["rows"]
    labels = [f"{r['dtype']}, ctx {r['context']}, {r['rows']} row{'s' * (r['rows'] > 1)}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    for part in ("linears", "attention and the rest", "lm_head", "engine"):
        ms = [max(0.0, r.get(part, 0.0)) for r in rows]
        ax.barh(labels, ms, left=left, label=part)
        left = [a + b for a, b in zip(left, ms)]
    ax.plot([r["floor_ms"]["linears"] + r["floor_ms"]["lm_head"] for r in rows], labels, "k|",
            markersize=14, label="floor (weight bytes / bandwidth)")
    read = [(r["weights_read"], label) for r, label in zip(rows, labels)
            if r.get("weights_read") is not None]
    if read:
        ax.plot(*zip(*read), "kx", markersize=8, label="its weights read alone")
    ax.invert_yaxis()
    ax.set(xlabel="ms", title=f"{data['title']} ({data['machine']['date']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16,int8,q4_1")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--rows", default="1,5")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--publish", action="store_true")
    a = p.parse_args()
    lib = binding.load_library()
    if lib is None:
        raise SystemExit("the CPU kernel could not be built: nothing to take apart")
    contexts = [int(c) for c in a.contexts.split(",")]
    rows_list = [int(r) for r in a.rows.split(",")]
    bw = memory_bandwidth_gbs()
    rows = []
    for dtype in a.dtype.split(","):
        llm = LLM(a.target, device="cpu", max_num_seqs=1, max_model_len=4096,
                  **precision_args(dtype))
        model = llm.engine.model
        decode = decode_against_read(llm)
        for context in contexts:
            for n in rows_list:
                r = {"dtype": dtype, "context": context, "rows": n,
                     **split(llm, context, n, a.repeats), "weight_bytes": weight_bytes(model)}
                if n == 1 and context == DECODE_CONTEXT:
                    r["decode_step"] = decode["decode_ms"]
                    r["engine"] = decode["decode_ms"] - r["forward"] - r["lm_head"]
                    r["weights_read"], r["decode_over_read"] = (decode["read_ms"],
                                                                decode["over_read"])
                rows.append(r)
                print(json.dumps(r), flush=True)
        del llm, model
    kernel = binding.cpu_features(lib)
    bw = max(bw, memory_bandwidth_gbs())        # the floors by the better of two readings
    for r in rows:
        r["floor_ms"] = {k: b / bw / 1e6 for k, b in r["weight_bytes"].items()}
    data = {"benchmark": "step-split", "title": f"{a.target}: a CPU decode step taken apart",
            "command": "python benchmarks/step_split.py " + " ".join(sys.argv[1:]),
            "machine": machine(), "kernel": kernel, "bandwidth_gbs": bw, "rows": rows}
    decode = next((r for r in rows if "engine" in r), None)
    summary = (f" · {decode['dtype']} decode {decode['decode_step']:.2f} ms: forward "
               f"{decode['forward']:.2f} (linears {decode['linears']:.2f}), lm_head "
               f"{decode['lm_head']:.2f}, engine {decode['engine']:.2f}" if decode else "")
    save(data, markdown(data), f"step-split-{a.target}", a.publish, summary, plot)


if __name__ == "__main__":
    main()
