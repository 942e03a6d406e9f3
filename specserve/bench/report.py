"""Benchmark results: one JSON per run, the source of truth, and the Markdown table and PNG
plot made from it. A run writes to the git-ignored runs/bench/; `--publish` also writes
benchmarks/latest/<benchmark>.{json,md,png} and adds a line to benchmarks/HISTORY.md.
`specserve bench report RUN.json [--readme]` makes the table and plot again (or the README's
method table)."""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
LATEST = REPO / "benchmarks" / "latest"
HISTORY = REPO / "benchmarks" / "HISTORY.md"
BASE = "specserve no-spec"


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/bench",
                   help="directory for the run's JSON, table and plot (default: runs/bench)")
    p.add_argument("--publish", action="store_true",
                   help="also write them to benchmarks/latest/ and add a line to "
                        "benchmarks/HISTORY.md")


def save(data: dict, out: str | Path, publish: bool = False,
         stem: str | None = None) -> dict[str, str]:
    """Write the run's JSON, Markdown and PNG (named `stem`, by default the benchmark and the
    time); returns their paths."""
    stem = stem or f"{data['benchmark']}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    paths = _write(data, Path(out), stem)
    if publish:
        paths["published"] = publish_run(data)
    return paths


def publish_run(data: dict) -> str:
    """Write a run to benchmarks/latest/ (one name per benchmark, device type and target other
    than the toy zoo's: a GPU run, one on `random:llama-3.2-1b`, `padded:...` or
    `smollm2-135m-instruct` does not replace the CPU run on the zoo) and add its line to
    HISTORY.md; returns the JSON's path. A run that names itself (`published_name`: the GPU
    check, whose device and models are its own) keeps that name."""
    name = data.get("published_name")
    if name is None:
        s = data["settings"]
        device = torch.device(s.get("device", "cpu")).type
        name = data["benchmark"] + published_suffix(data["machine"], device)
        target = s.get("target", "")
        if target and not target.startswith("models/"):
            built = target.removeprefix("random:").replace("models/", "")
            name += "-" + re.sub(r"[^A-Za-z0-9]+", "-", built).strip("-")
    path = _write(data, LATEST, name)["json"]
    with HISTORY.open("a") as f:
        f.write(history_line(data) + "\n")
    return path


def published_suffix(machine: dict, device: str = "cpu") -> str:
    """What tells a published run's name from the AVX-512 CPU's (the set README cites): the
    GPU's device type, or another CPU's vector instruction set ("-avx2")."""
    if device != "cpu":
        return f"-{device}"
    return "" if machine.get("isa", "avx512") == "avx512" else f"-{machine['isa']}"


def _write(data: dict, directory: Path, stem: str) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    # the stem as given: a dot in it (`...-t0.7`) is part of the name, not a suffix to replace
    out = {"json": str(directory / f"{stem}.json"), "table": str(directory / f"{stem}.md")}
    Path(out["json"]).write_text(json.dumps(data, indent=1) + "\n")
    Path(out["table"]).write_text(markdown(data))
    if plot(data, directory / f"{stem}.png"):
        out["plot"] = str(directory / f"{stem}.png")
    return out


def _header(data: dict) -> list[str]:
    m = data["machine"]
    gpu = f"{m['gpu']} (CUDA {m['cuda']}) with " if "gpu" in m else ""
    return [f"## {data['title']}", "",
            f"- {m['date']}, commit {m['commit']}; {gpu}{m['cpu']} ({m.get('isa', m['arch'])}, "
            f"{m['cpus']} CPUs), {m['torch_threads']} torch threads, torch {m['torch']}",
            f"- command: `{data['command']}`"]


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def median_cell(median: float, rounds: list[float]) -> str:
    """ "median (min-max)": the range shows how far the machine's speed moved between rounds."""
    spread = f" ({min(rounds):.0f}-{max(rounds):.0f})" if len(rounds) > 1 else ""
    return f"{median:.1f}{spread}"


def latency_table(results: list[dict], dtypes: list[str] = ()) -> str:
    """One suite: a row per configuration with its speedups over no-spec (tokens/s: the first
    dtype's; decode speedup and efficiency: its own dtype's, named ", DTYPE" after the first)."""
    ref = next(r for r in results if r["name"] == BASE)
    own = {d: next((r for r in results if r["name"] == f"{BASE}, {d}"), ref) for d in dtypes[1:]}
    rows = ["| configuration | tokens/s (median; rounds' range) | speedup vs no-spec "
            "| TPOT ms (median) "
            "| decode speedup (own dtype) | tau | efficiency | acceptance rate "
            "| per-position acceptance "
            "| drafting ms/step | greedy output = no-spec | resident MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in results:
        name = r["name"] if r["note"] is None else f"{r['name']}, {r['note']}"
        tpot, tau, rate = r["median_tpot_ms"], r["tau"], r["acceptance_rate"]
        base = next((b for d, b in own.items() if r["name"].endswith(f", {d}")), ref)
        speedup = base["median_tpot_ms"] / tpot if tpot and base["median_tpot_ms"] else None
        decode = "" if speedup is None else f"{speedup:.2f}x"
        # tau is the speedup of free drafting with verify steps as cheap as decode steps
        efficiency = "" if speedup is None or tau is None else f"{speedup / tau:.0%}"
        pp = "" if r["per_pos"] is None else ", ".join(f"{x:.2f}" for x in r["per_pos"])
        draft = "" if r.get("draft_ms") is None else f"{r['draft_ms']:.2f}"
        rows.append(
            f"| {name} | {median_cell(r['median_tokens_per_s'], r.get('tokens_per_s') or [])} | "
            f"{r['median_tokens_per_s'] / ref['median_tokens_per_s']:.2f}x | "
            f"{'' if tpot is None else f'{tpot:.2f}'} | {decode} | "
            f"{'' if tau is None else f'{tau:.2f}'} | {efficiency} | "
            f"{'' if rate is None else f'{rate:.1%}'} | {pp} | {draft} | "
            f"{r['same_output'] or ''} | {_mb(r.get('resident_mb'))} |")
    return "\n".join(rows)


def _floor(data: dict, name: str) -> str:
    """" (floor F ms, weights read W ms: decode Dx that, R MB resident)": the configuration's
    bytes streamed per step over the measured bandwidth, the time to read those weights alone
    with the decode's ratio to it, and the memory its engine took (newer runs only)."""
    streamed = data.get("weight_bytes_streamed_by_config", {}).get(name)
    read = data.get("weights_read_ms", {}).get(name)
    resident = data.get("resident_mb", {}).get(name)
    parts = ([] if streamed is None else [f"floor {streamed / data['bandwidth_gbs'] / 1e6:.2f} ms"]
             ) + ([] if read is None else [f"weights read {read:.2f} ms: decode "
                                           f"{data['decode_over_read'][name]:.2f}x that"]
             ) + ([] if resident is None else [f"{_mb(resident)} MB resident"])
    return f" ({', '.join(parts)})" if parts else ""


def _step_costs(data: dict) -> list[str]:
    """"- one target step of 1 / 2 / ... rows: ..." (what a verify of K drafts costs beside a
    decode), for runs that measured it."""
    if "step_ms" not in data:
        return []
    rows = data["step_ms"]["rows"]
    return [f"- one target step of {' / '.join(map(str, rows))} rows (a decode, then verifies): "
            + "; ".join(f"{name} {' / '.join(f'{ms:.1f}' for ms in times)} ms "
                        f"({' / '.join(f'{ms / times[0]:.2f}' for ms in times[1:])}x one row)"
                        for name, times in data["step_ms"]["by_config"].items())]


def _latency_markdown(data: dict) -> list[str]:
    s = data["settings"]
    bw, wb = data["bandwidth_gbs"], data["weight_bytes"]
    draft = f", draft {s['draft']}" if s.get("draft") else ""
    lines = [f"- target {s['target']}{draft}, dtypes {', '.join(s['dtypes'])}, "
             f"temperature {s['temperature']}, {s['num_prompts']} prompts x {s['max_tokens']} "
             f"new tokens, median of {s['rounds']} rounds, speculative_config extra: "
             f"{s['speculative_config_extra'] or 'none'}",
             f"- measured read bandwidth {bw:.1f} GB/s; target weights read per step "
             f"{wb / 1e6:.1f} MB in float32, {data['weight_bytes_streamed'] / 1e6:.1f} MB as the "
             f"CPU kernel streams them: bandwidth floor "
             f"{data['weight_bytes_streamed'] / bw / 1e6:.2f} ms/token",
             "- batch-1 greedy decode alone (prompt time taken out): " + "; ".join(
                 f"{name} {ms:.2f} ms/token" + _floor(data, name)
                 for name, ms in data["decode_ms_per_token"].items()),
             *_step_costs(data),
             f"- time to the first token of a {' / '.join(map(str, data['prompt_ms']['lengths']))}"
             "-token prompt: " + "; ".join(
                 f"{name} {' / '.join(f'{ms:.1f}' for ms in times)} ms"
                 for name, times in data["prompt_ms"]["by_config"].items()), ""]
    for key, results in data["suites"].items():
        lines += [f"### {key}", "", latency_table(results, s["dtypes"]), ""]
    return lines


def _serve_markdown(data: dict) -> list[str]:
    s = data["settings"]
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in data["rows"]
            if r["config"] == "no-spec"}
    lines = [f"- target {s['target']}, draft {s['draft']}, dtype {s['dtype']}, K={s['k']}, "
             f"greedy, {s['prompt_set']} prompts, {s['max_tokens']} tokens per request, closed "
             f"loop, {s['requests_per_client']} requests per client, {s['rounds']} interleaved "
             f"rounds (median throughput), {s['threads']} torch threads for the server", "",
             "| config | concurrency | output tok/s | vs no-spec | TTFT p50/p90/p99 ms | "
             "TPOT p50/p90/p99 ms | offline TPOT ms | errors |",
             "|---|---:|---:|---:|---|---|---:|---:|"]
    for r in data["rows"]:
        off = "" if r["offline_ms_per_token"] is None else f"{r['offline_ms_per_token']:.2f}"
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | "
            f"{r['output_tokens_per_s'] / base[r['concurrency']]:.2f}x | "
            f"{r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f}/{r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p50_ms']:.2f}/{r['tpot_p90_ms']:.2f}/{r['tpot_p99_ms']:.2f} | {off} | "
            f"{r['errors']} |")
    return lines + [""]


def _tree_markdown(data: dict) -> list[str]:
    s = data["settings"]
    return [f"- {s['method']} on {s['target']}, {', '.join(s['prompt_sets'])} prompts, "
            f"temperature {s['temperature']}; node acceptance measured on a "
            f"{s['measured_nodes']}-node tree", "",
            "| nodes | expected tau | speculative_token_tree |", "|---:|---:|---|",
            *(f"| {r['nodes']} | {r['expected_tau']:.2f} | `{r['tree']}` |"
              for r in data["rows"]), ""]


def _prefix_markdown(data: dict) -> list[str]:
    s = data["settings"]
    lines = [f"- {s['target']}, {s['dtype']}, speculative_config "
             f"`{json.dumps(s['speculative_config'])}`; requests sent one at a time, greedy, "
             f"{s['max_tokens']} tokens each; median of {s['rounds']} interleaved rounds, each "
             "starting with an empty prefix cache"]
    if "prefix_copy" in data:
        c = data["prefix_copy"]
        lines.append(f"- the cache's own cost: copying {c['positions']} cached positions into a "
                     f"request's slot (every cache) {c['copy_ms']:.1f} ms, storing them "
                     f"{c['store_ms']:.1f} ms (medians of 7)")
    lines.append("")
    for name, w in data["workloads"].items():
        ratio = w["later_over_first_on"]
        later = ("" if ratio is None else f"later requests' TTFT {ratio:.3f}x the first's "
                 f"and {w['later_on_over_off']:.3f}x their own with caching off, ")
        lines += [f"### {name}: hit rate {w['hit_rate']:.0%}, {later}outputs "
                  f"{'equal' if w['outputs_equal'] else 'DIFFERENT'} with it off", "",
                  "| request | prompt tokens | cached | TTFT off (ms) | TTFT on (ms) | on/off |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {i + 1} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                  f"{median_cell(r['ttft_ms_off'], r['ttft_ms_off_rounds'])} | "
                  f"{median_cell(r['ttft_ms_on'], r['ttft_ms_on_rounds'])} | "
                  f"{r['ttft_ms_on'] / r['ttft_ms_off']:.3f} |"
                  for i, r in enumerate(w["requests"])]
        lines.append("")
    return lines


def _structured_markdown(data: dict) -> list[str]:
    s = data["settings"]
    lines = [f"- {s['target']}, {s['dtype']}, batch 1, greedy, up to {s['max_tokens']} tokens, "
             f"{len(s['tasks'])} held-out JSON schemas through the chat template; decode "
             f"tokens/s after the first token, median of {s['rounds']} interleaved rounds", "",
             "| configuration | tokens/s | vs no-spec | schema-valid | equal to no-spec | tau |",
             "|---|---:|---:|---:|---|---:|"]
    for r in data["rows"]:
        tau = r["mean_acceptance_length"]
        lines.append(f"| {r['config']} | {median_cell(r['tokens_per_s'], r['rounds'])} | "
                     f"{r['speedup']:.2f}x | {r['valid']:.0%} | "
                     f"{'yes' if r['equal_to_no_spec'] else 'NO'} | "
                     f"{'' if tau is None else f'{tau:.2f}'} |")
    return lines + ["", f"Example output: `{data['example']}`", ""]


def _gpu_rows_and_base(data: dict):
    """Each row with the specserve no-spec row of its model and batch (or None)."""
    base = {(r["model"], r["batch"]): r for r in data["rows"]
            if r["engine"] == "specserve" and r["method"] == "none"}
    return [(r, base.get((r["model"], r["batch"]))) for r in data["rows"]]


def _gpu_markdown(data: dict) -> list[str]:
    lines = [f"- copy bandwidth {data['copy_bandwidth_gbs']:.0f} GB/s (read + written); floor = "
             "weight bytes a step reads / that bandwidth",
             f"- {data['max_tokens']} new tokens after a {data['prompt_tokens']}-token prompt per "
             f"sequence, median of {data['rounds']} rounds after a warm-up; speculation's "
             f"acceptance synthetic at {data['acceptance']} per draft token (random weights)",
             ""]
    pairs = _gpu_rows_and_base(data)
    for model in dict.fromkeys(r["model"] for r in data["rows"]):
        lines += [f"### {model}", "",
                  "| engine | method | K | batch | tokens/s | ms/token | vs no-spec | tau | "
                  "floor ms/token | target step alone, ms |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r, base in pairs:
            if r["model"] != model:
                continue
            ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
            lines.append(f"| {r['engine']} | {r['method']} | {r['k'] or ''} | {r['batch']} | "
                         f"{r['tokens_per_s']:.1f} | {r['ms_per_token']:.2f} | {ratio} | "
                         f"{r['tau'] or ''} | {r['floor_ms_per_token']:.2f} | "
                         f"{r.get('target_step_ms', '')} |")
        lines.append("")
    return lines


_MARKDOWN = {"latency": _latency_markdown, "serve": _serve_markdown, "tree": _tree_markdown,
             "prefix": _prefix_markdown, "structured": _structured_markdown,
             "gpu": _gpu_markdown}


def markdown(data: dict) -> str:
    return "\n".join(_header(data) + _MARKDOWN[data["benchmark"]](data)) + "\n"


def plot(data: dict, path: Path) -> bool:
    """The run's PNG (latency: tokens/s per suite; serve: throughput and TPOT by concurrency;
    prefix: time to first token per request; tree: expected tau by tree size); False for a
    benchmark without one."""
    if data["benchmark"] not in ("latency", "serve", "prefix", "tree"):
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if data["benchmark"] == "latency":
        suites = data["suites"]
        # one panel per suite, stacked: long configuration names keep their room on the left
        names = [r["name"] for results in suites.values() for r in results]
        rows = max(len(results) for results in suites.values())
        fig, axes = plt.subplots(len(suites), 1, squeeze=False, figsize=(
            5 + 0.075 * max(map(len, names)), len(suites) * (0.28 * rows + 1.1)))
        for ax, (title, results) in zip(axes[:, 0], suites.items()):
            ax.barh([r["name"] for r in results], [r["median_tokens_per_s"] for r in results])
            ax.set(title=title, xlabel="tokens/s (median)")
            ax.invert_yaxis()
    elif data["benchmark"] == "prefix":
        ws = data["workloads"]
        fig, axes = plt.subplots(1, len(ws), figsize=(5 * len(ws), 4), squeeze=False)
        for ax, (name, w) in zip(axes[0], ws.items()):
            n = range(1, len(w["requests"]) + 1)
            for key, label in (("ttft_ms_off", "caching off"), ("ttft_ms_on", "caching on")):
                ax.plot(n, [r[key] for r in w["requests"]], "o-", label=label)
            ax.set(title=name, xlabel="request", ylabel="time to first token (ms)")
            ax.legend(fontsize=8)
    elif data["benchmark"] == "tree":
        rows, rates = data["rows"], data["node_rates"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["nodes"] for r in rows], [r["expected_tau"] for r in rows], "o-",
                label="best tree of n nodes")
        # the chain's nodes are (0,), (0, 0), ...: 1 + its first n rates
        chain = [i for i, q in enumerate(data["node_paths"]) if set(q) == {0}]
        ax.plot(range(1, len(chain) + 1), [1 + sum(rates[i] for i in chain[:n])
                                           for n in range(1, len(chain) + 1)], "s--",
                label="chain of n drafts")
        ax.set(xlabel="draft nodes", ylabel="expected tau",
               title=f"{data['settings']['method']} on {data['settings']['target']}")
        ax.legend(fontsize=8)
    else:
        rows = data["rows"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for name in dict.fromkeys(r["config"] for r in rows):
            rs = [r for r in rows if r["config"] == name]
            a.plot([r["concurrency"] for r in rs], [r["output_tokens_per_s"] for r in rs], "o-",
                   label=name)
            b.plot([r["concurrency"] for r in rs], [r["tpot_p50_ms"] for r in rs], "o-",
                   label=name)
        a.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", title="throughput")
        b.set(xlabel="concurrency", ylabel="TPOT p50 (ms)", xscale="log", title="time per token")
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _best(data: dict) -> dict[str, tuple[str, float]]:
    """Per suite (or concurrency), the configuration with the best speedup over no-spec."""
    best: dict[str, tuple[str, float]] = {}
    if data["benchmark"] == "latency":
        for key, results in data["suites"].items():
            ref = next(r for r in results if r["name"] == BASE)["median_tokens_per_s"]
            for r in results:
                if "no-spec" not in r["name"]:
                    v = r["median_tokens_per_s"] / ref
                    if key not in best or v > best[key][1]:
                        best[key] = (r["name"].removeprefix("specserve "), v)
    elif data["benchmark"] == "serve":
        base = {r["concurrency"]: r["output_tokens_per_s"] for r in data["rows"]
                if r["config"] == "no-spec"}
        for r in data["rows"]:
            key, v = f"concurrency {r['concurrency']}", r["output_tokens_per_s"] / base[
                r["concurrency"]]
            if r["config"] != "no-spec" and (key not in best or v > best[key][1]):
                best[key] = (r["config"], v)
    elif data["benchmark"] == "structured":
        for r in data["rows"]:
            if r["config"] != "no-spec" and ("json schema" not in best
                                             or r["speedup"] > best["json schema"][1]):
                best["json schema"] = (r["config"], r["speedup"])
    elif data["benchmark"] == "prefix":
        for name, w in data["workloads"].items():
            if w["later_on_over_off"]:
                best[name] = ("later requests' TTFT, caching on / off", w["later_on_over_off"])
    elif data["benchmark"] == "gpu":
        for r, base in _gpu_rows_and_base(data):
            key = f"{r['model']}, batch {r['batch']}"
            if base is not None and r is not base:
                v = r["tokens_per_s"] / base["tokens_per_s"]
                if key not in best or v > best[key][1]:
                    best[key] = (f"{r['engine']} {r['method']}", v)
    return best


def history_line(data: dict) -> str:
    m = data["machine"]
    best = "; ".join(f"{k}: {n} {v:.2f}x" for k, (n, v) in _best(data).items())
    return (f"- {m['date']} · {m['commit']} · {data['title']} · `{data['command']}`"
            + (f" · best: {best}" if best else ""))


def readme_table(data: dict) -> str:
    """The README's method table from a latency run with completion and editing suites at
    batch 1 and 8: speedup in tokens/s, decode (TPOT) speedup, tau."""
    suites = data["suites"]

    def get(prompts: str, batch: int) -> dict[str, dict]:
        return {r["name"]: r for r in suites.get(f"{prompts}, batch {batch}", [])}
    c1, e1, c8, e8 = get("completion", 1), get("editing", 1), get("completion", 8), \
        get("editing", 8)
    if BASE not in c1 or BASE not in e1:
        raise ValueError("the README's method table needs a latency run with no-spec in its "
                         "completion and editing suites at batch 1; this run has: "
                         f"{', '.join(suites)} (its Markdown has the tables of any run)")

    def speedup(s: dict[str, dict], name: str) -> str:
        return (f"{s[name]['median_tokens_per_s'] / s[BASE]['median_tokens_per_s']:.2f}x"
                if name in s else "")

    def decode(s: dict[str, dict], name: str) -> str:
        return (f"{s[BASE]['median_tpot_ms'] / s[name]['median_tpot_ms']:.2f}x"
                if name in s and s[name]["median_tpot_ms"] else "")
    m, st = data["machine"], data["settings"]
    lines = [f"Measured {m['date']} on {m['cpu']} ({m['cpus']} CPUs), {st['dtypes'][0]}, "
             f"greedy, {st['num_prompts']} held-out prompts x {st['max_tokens']} tokens "
             f"(`{data['command']}`, [benchmarks/latest/latency.md]"
             "(benchmarks/latest/latency.md)); speedup in tokens/s over specserve without "
             f"speculation ({c1[BASE]['median_tokens_per_s']:.0f} / "
             f"{e1[BASE]['median_tokens_per_s']:.0f} tokens/s at batch 1); \"decode\" is the "
             "speedup in time per output token after the first (prefill left out); each "
             "method at its fastest K:", "",
             "| method | completion, batch 1 | editing, batch 1 | decode, batch 1 | "
             "completion, batch 8 | editing, batch 8 | tau (completion / editing) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    names = sorted((n for n in c1 if n != BASE and n.startswith("specserve")),
                   key=lambda n: -c1[n]["median_tokens_per_s"])
    best: dict[str, str] = {}           # one row per method: its fastest K
    for n in names:
        best.setdefault(re.sub(r"\+k=\d+| \(K=\d+\)", "", n), n)
    for n in best.values():
        tau = " / ".join(f"{s[n]['tau']:.2f}" for s in (c1, e1) if n in s and s[n]["tau"])
        lines.append(f"| {n.removeprefix('specserve ')} | {speedup(c1, n)} | {speedup(e1, n)} | "
                     f"{decode(c1, n)} / {decode(e1, n)} | {speedup(c8, n)} | "
                     f"{speedup(e8, n)} | {tau} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="specserve bench report", description=__doc__)
    p.add_argument("mode", choices=["report"])
    p.add_argument("json", help="a run's JSON (runs/bench/... or benchmarks/latest/...)")
    p.add_argument("--readme", action="store_true",
                   help="print the README's method table instead (latency runs)")
    p.add_argument("--publish", action="store_true",
                   help="publish the run to benchmarks/latest/ and HISTORY.md (a run taken on "
                        "another machine, e.g. a GPU host)")
    a = p.parse_args(argv)
    path = Path(a.json)
    data = json.loads(path.read_text())
    if a.readme:
        print(readme_table(data))
        return
    if a.publish:
        print(json.dumps({"published": publish_run(data)}))
        return
    path.with_suffix(".md").write_text(markdown(data))
    plot(data, path.with_suffix(".png"))
    print(json.dumps({"table": str(path.with_suffix(".md"))}))
