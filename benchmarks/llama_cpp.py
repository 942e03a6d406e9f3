"""specserve against llama.cpp on the same weights, side by side in one run (CPU, batch 1,
greedy). Not a test; CI does not run it.

    python benchmarks/llama_cpp.py [--random llama-3.2-1b] [--tokens 128] [-k 2,3,4]
                                   [--rounds 3] [--publish]

1. Builds llama.cpp from the llama-cpp-python source distribution on PyPI (its vendored
   llama.cpp; `llama-bench`, `llama-speculative-simple`) under runs/llama.cpp/, once.
2. Converts the bundled target and draft (and a random-weight model of a real shape, where
   decoding is bound by reading weights) to GGUF with llama.cpp's convert_hf_to_gguf.py, in
   BF16 and Q8_0. The zoo's byte-level BPE is GPT-2's pre-tokenizer, which the converter cannot
   recognise by its hash of the tokens: it is told so.
3. Decode speed, prompt time left out, in tokens/s, every configuration once per round, the
   rounds' order reversed each round (this VM's speed drifts by a third within minutes: each
   configuration then meets every speed alike), the median over the rounds:
   - llama.cpp plain: `llama-bench -p 0 -n TOKENS -r 1`;
   - llama.cpp speculative: `llama-speculative-simple` with the draft (greedy, draft-max K),
     the median over the held-out completion prompts of its "decoded ... t/s";
   - specserve: the median over the same prompts of the time per output token after the first
     (no-spec, draft_model and eagle3; bfloat16 beside BF16, int8 beside Q8_0, the drafter's
     weights in the same precision as the target's, as llama.cpp's draft GGUF; with --gguf,
     the file's own Q4_1 / Q8_0 blocks, its drafters in q8_0). Each engine
     is loaded once and warmed up before the first round.
   Speculation runs at each K of `-k` on both sides: each side's best K counts.
Writes runs/llama_cpp/llama-cpp-DATE.{json,md}; with --publish, benchmarks/latest/llama-cpp.*
(llama-cpp-GGUF.* with --gguf) and a line in benchmarks/HISTORY.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.bench.methods import prompt_set
from specserve.bench.probes import machine, memory_bandwidth_gbs, weight_bytes
from specserve.bench.random_models import resolve
from specserve.bench.report import median_cell, published_suffix
from specserve.bench.runners import precision_args
from specserve.data.prompts import PROMPT_SETS
from specserve.kernels.cpu import cpu_flags
from specserve.models.catalogue import bundled_drafters, resolve_model
from specserve.train.draft_states import write_tokenizer

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "runs" / "llama.cpp"
PACKAGE = "llama-cpp-python"
TOOLS = ("llama-bench", "llama-speculative-simple", "llama-quantize")
# the specserve side beside each GGUF type: the LLM's arguments and the speculative_config
# keys that put the drafter's weights in the same precision (llama.cpp drafts with the draft
# GGUF of that type)
PRECISIONS = {"bf16": (precision_args("bfloat16"), {}),
              "q8_0": (precision_args("int8"), {"quantization": "int8"})}
# a shipped GGUF's types, each beside specserve running that file's own blocks;
# drafters in q8_0 beside 4-bit targets
# the draft GGUF llama.cpp drafts with beside each of those (the type of specserve's drafter)
DRAFT_OUTTYPE = {"q4_1 (as shipped)": "q8_0", "q8_0": "q8_0", "bf16": "bf16"}
# a bundled drafter's speculative_config where its catalogue suffix is not its method name
BUNDLED_SPECS = {"pard": {"method": "draft_model", "parallel_drafting": True},
                 "peagle": {"method": "eagle3", "parallel_drafting": True}}
HEAD_K = {"mtp": 1, "pard": 4}
GGUF_PRECISIONS = {"q4_1 (as shipped)": (precision_args("q4_1"), {"quantization": "q8_0"}),
                   "q8_0": (precision_args("q8_0"), {"quantization": "q8_0"}),
                   "bf16": PRECISIONS["bf16"]}


def run(cmd: list[str], **kw) -> str:
    print("$", " ".join(map(str, cmd)), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", **kw)
    if out.returncode:
        raise SystemExit(f"{cmd[0]} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out.stdout + out.stderr


def build() -> Path:
    """llama.cpp's directory (the vendored copy in the sdist), its tools built."""
    bins = WORK / "build" / "bin"
    sources = sorted(WORK.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if sources and all((bins / t).is_file() for t in TOOLS):
        return sources[-1]
    WORK.mkdir(parents=True, exist_ok=True)
    if not sources:
        run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary",
             ":all:", "-d", str(WORK)])
        sdist = sorted(WORK.glob("llama_cpp_python-*.tar.gz"))[-1]
        with tarfile.open(sdist) as t:
            t.extractall(WORK, filter="data")
        sources = sorted(WORK.glob("llama_cpp_python-*/vendor/llama.cpp"))
    src = sources[-1]
    # Nothing fetched at build time (no web UI, no HTTPS), only the two tools. Built for the
    # CPU's instruction sets but without AMX: on the AMX machine this was written on, ggml's
    # AMX Q8_0 kernel died with SIGILL on every prompt (its decode path does not use AMX).
    flags = cpu_flags()
    isa = [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for name, flag in (
        ("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"),
        ("BMI2", "bmi2"), ("AVX512", "avx512f"), ("AVX512_VBMI", "avx512vbmi"),
        ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"),
        ("AVX_VNNI", "avx_vnni"))]
    run(["cmake", "-S", str(src), "-B", str(WORK / "build"), "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=OFF", *isa, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
         "-DGGML_AMX_BF16=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
         "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"])
    run(["cmake", "--build", str(WORK / "build"), "--target", *TOOLS, "-j",
         str(os.cpu_count() or 2)])
    return src


_CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import conversion.base
import conversion.llama
# the zoo's tokenizer: byte-level BPE with GPT-2's pre-tokenizer (unknown to the hash list),
# no sentencepiece model to try first
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
conversion.llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def gguf(src: Path, model_dir: str, outtype: str) -> Path:
    out = WORK / "gguf" / f"{Path(model_dir).name}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-c", _CONVERT, str(src), model_dir, "--outtype", outtype,
             "--outfile", str(out)])
    return out


def with_tokenizer(draft: Path, target: Path) -> str:
    """A bundled draft as the converter reads it: its files linked beside the target's
    tokenizer (the zoo keeps the draft without one: the target holds it)."""
    out = WORK / "drafts" / draft.name
    out.mkdir(parents=True, exist_ok=True)
    for f in draft.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    write_tokenizer(target, out)
    return str(out)


def llama_plain(model: Path, tokens: int, threads: int) -> float:
    out = run([str(WORK / "build" / "bin" / "llama-bench"), "-m", str(model), "-p", "0", "-n",
               str(tokens), "-t", str(threads), "-r", "1", "-o", "json"])
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    return float(rows[0]["avg_ts"])


def requantize(shipped: Path, outtype: str) -> Path:
    """The shipped GGUF rewritten by llama-quantize as `outtype` (its weights dequantized from
    the shipped blocks, then stored as outtype): the file both engines then read."""
    out = WORK / "gguf" / f"{shipped.stem}-{outtype.lower()}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        run([str(WORK / "build" / "bin" / "llama-quantize"), "--allow-requantize", str(shipped),
             str(out), outtype.upper()])
    return out


def llama_speculative(target: Path, draft: Path | None, prompts: list[str], tokens: int, k: int,
                      threads: int) -> float:
    """Decode tokens/s of llama-speculative-simple, the median over prompts: drafting with
    `draft` (draft-simple), or without one by n-gram lookup in the context (ngram-simple)."""
    how = (["-md", str(draft), "-td", str(threads), "--spec-type", "draft-simple"] if draft
           else ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", str(k)])
    speeds = []
    for p in prompts:
        out = run([str(WORK / "build" / "bin" / "llama-speculative-simple"), "-m", str(target),
                   *how, "-p", p, "-n", str(tokens), "--spec-draft-n-max", str(k),
                   "--spec-draft-n-min", "0", "--temp", "0", "-t", str(threads), "-c", "1024"])
        speeds.append(float(re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+"
                                      r"([\d.]+) t/s", out)[1]))
    return statistics.median(speeds)


def specserve_engine(target: str, spec: dict | None, precision: dict, prompt: str) -> LLM:
    """An engine for one configuration, warmed up on one prompt."""
    # one sequence of a short context: the many engines of a run share the machine's memory
    llm = LLM(target, device="cpu", speculative_config=spec, max_num_seqs=1, freeze_gc=True,
              max_model_len=2048, **precision)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return llm


def specserve_decode(llm: LLM, prompts: list[str], tokens: int, ignore_eos: bool = True
                     ) -> float:
    """tokens/s after the first token, median over prompts. Speculative runs stop at EOS as
    llama-speculative-simple does (text past an answer's end tends to loop, which drafting by
    lookup would speed up); plain runs make all `tokens`, as llama-bench does."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=ignore_eos)
    outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    return statistics.median((len(o.outputs[0].token_ids) - 1)
                             / (o.metrics["finish_time"] - o.metrics["first_token_time"])
                             for o in outs)


def bits_per_byte(target: str, precision: dict, texts: list[str]) -> float:
    """specserve's held-out bits per byte of `texts` (each token after the first scored from
    the prefill's prompt log-probabilities): what a precision costs in quality."""
    llm = LLM(target, device="cpu", max_num_seqs=1, max_model_len=1024, **precision)
    tok = llm.get_tokenizer()
    nll = nbytes = 0.0
    for text in texts:
        out = llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        ids = out.prompt_token_ids
        nll -= sum(lp[t] for t, lp in zip(ids[1:], out.prompt_logprobs[1:]))
        nbytes += len(text.encode()) - len(tok.decode(ids[:1]).encode())
    return nll / math.log(2) / nbytes


def gguf_runs(a: argparse.Namespace, src: Path, ks: list[int], streamed: dict[tuple, dict],
              quality: dict[str, float]) -> dict[tuple, Callable[[], float]]:
    """A shipped GGUF (a catalogue name, e.g. smollm2-135m-instruct) as shipped and rewritten
    as Q8_0 and BF16, each file read by both engines: plain and n-gram lookup on both sides,
    the bundled draft model on both sides (llama.cpp's draft-simple with it converted to GGUF),
    and specserve's other drafters bundled for it. `streamed` gets each (model, precision)'s bytes
    read per token on each side (the file's tensors; specserve's weights as it holds them);
    `quality` each precision's held-out bits per byte in specserve (float32: the shipped
    blocks' values, unquantized inputs)."""
    shipped = Path(resolve_model(a.gguf))
    texts = PROMPT_SETS["chat"](8) + PROMPT_SETS["code"](8)
    quality["float32 (the shipped weights)"] = bits_per_byte(str(shipped), {}, texts)
    prompts = prompt_set("chat", a.num_prompts, a.gguf)
    name = f"{a.gguf} ({shipped.name}), held-out chat prompts"
    heads = {d.removeprefix(f"{a.gguf}-"): d for d in bundled_drafters(a.gguf)}
    runs: dict[tuple, Callable[[], float]] = {}
    for label, (precision, drafter) in GGUF_PRECISIONS.items():
        path = shipped if label.endswith("(as shipped)") else requantize(shipped, label)
        quality[label] = bits_per_byte(str(path), precision, texts)
        runs[(name, label, "no speculation", "llama.cpp")] = functools.partial(
            llama_plain, path, a.tokens, a.threads)
        specs: dict[str, dict | None] = {"no speculation": None}
        for k in ks:
            runs[(name, label, f"n-gram lookup, K={k}", "llama.cpp")] = functools.partial(
                llama_speculative, path, None, prompts, a.tokens, k, a.threads)
            specs[f"n-gram lookup, K={k}"] = {"method": "ngram", "num_speculative_tokens": k}
        if "draft_model" in heads:       # the bundled draft on both sides, at every K
            draft = gguf(src, with_tokenizer(Path(resolve_model(heads["draft_model"])),
                                             shipped), DRAFT_OUTTYPE[label])
            for k in ks:
                runs[(name, label, f"draft model (bundled), K={k}", "llama.cpp")] = \
                    functools.partial(llama_speculative, path, draft, prompts, a.tokens, k,
                                      a.threads)
                specs[f"draft model (bundled), K={k}"] = {
                    "method": "draft_model", "model": heads["draft_model"],
                    "num_speculative_tokens": k, **drafter}
        for method, model in heads.items():
            if method == "draft_model":
                continue
            k = HEAD_K.get(method, 2)                 # each one's best K in the latency runs
            spec = BUNDLED_SPECS.get(method, {"method": method})
            specs[f"{method} (bundled), K={k} (specserve only)"] = spec | {
                "model": model, "num_speculative_tokens": k, **drafter}
        if "eagle3" in heads:   # what a user would pick: the head, prompt lookup, adaptive K
            specs["auto (EAGLE-3 head + prompt lookup, adaptive K) (specserve only)"] = {
                "method": "auto", "model": heads["eagle3"], **drafter}
        for config, spec in specs.items():
            llm = specserve_engine(str(path), spec, precision, prompts[0])
            runs[(name, label, config, "specserve")] = functools.partial(
                specserve_decode, llm, prompts, a.tokens, spec is None)
            if spec is None:
                streamed[(name, label)] = {
                    "llama.cpp": path.stat().st_size,
                    "specserve": weight_bytes(llm.engine.model, streamed=True)}
    return runs


def _cell(v: dict, side: str) -> str:
    return median_cell(v[side], v.get(f"{side} rounds") or []) if side in v else ""


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [f"## {data['title']}", "",
             f"- {m['date']}, commit {m['commit']}; {m['cpu']} ({m['cpus']} CPUs), "
             f"{data['threads']} threads; llama.cpp from {data['llama_cpp']}",
             f"- command: `{data['command']}`",
             f"- batch 1, greedy, decode tokens/s after the first token: median over "
             f"{data.get('rounds', 1)} rounds (their range); K={data['k']}; {data['tokens']} "
             f"new tokens, {data['num_prompts']} held-out {data.get('prompts', 'completion')} "
             "prompts", ""]
    for name, rows in data["models"].items():
        best_l = max(v["llama.cpp"] for configs in rows.values() for v in configs.values()
                     if "llama.cpp" in v)
        lines += [f"### {name}", "",
                  "| precision | configuration | llama.cpp t/s | specserve t/s "
                  "| specserve / llama.cpp | vs llama.cpp's best |",
                  "|---|---|---:|---:|---:|---:|"]
        for prec, configs in rows.items():
            for config, v in configs.items():
                l, s = v.get("llama.cpp"), v.get("specserve")
                ratio = "" if l is None or s is None else f"{s / l:.2f}x"
                best = "" if s is None else f"{s / best_l:.2f}x"
                lines.append(f"| {prec} | {config} | {_cell(v, 'llama.cpp')} | "
                             f"{_cell(v, 'specserve')} | {ratio} | {best} |")
        lines.append("")
    if data.get("floor_tokens_per_s"):
        lines += [f"Bandwidth floor (read bandwidth {data['bandwidth_gbs']:.1f} GB/s measured "
                  "in the run; bytes a token reads on each side), tokens/s:", "",
                  "| model / precision | llama.cpp | specserve |", "|---|---:|---:|"]
        lines += [f"| {k} | {v['llama.cpp']:.1f} | {v['specserve']:.1f} |"
                  for k, v in data["floor_tokens_per_s"].items()]
        lines.append("")
    if data.get("bits_per_byte"):
        lines += ["specserve's bits per byte on 16 held-out chat and code prompts, by "
                  "precision (each file's weights as that precision holds them):", "",
                  "| precision | bits/byte |", "|---|---:|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in data["bits_per_byte"].items()]
        lines.append("")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Per model and precision, each configuration's tokens/s on both sides (medians)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(model, prec, configs) for model, rows in data["models"].items()
              for prec, configs in rows.items()]
    cols = min(3, len(panels))
    grid = -(-len(panels) // cols)
    height = max(len(c) for _, _, c in panels) * 0.3 + 1.2
    fig, axes = plt.subplots(grid, cols, figsize=(5.5 * cols, height * grid), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    for ax, (model, prec, configs) in zip(axes.flat, panels):
        y = range(len(configs))
        for i, side in enumerate(("llama.cpp", "specserve")):
            ax.barh([j + 0.4 * i for j in y], [v.get(side, 0.0) for v in configs.values()],
                    height=0.4, label=side)
        ax.set_yticks([j + 0.2 for j in y], list(configs), fontsize=7)
        ax.invert_yaxis()
        ax.set(xlabel="decode tokens/s (median)", title=f"{model.split(' (')[0]}: {prec}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/code-target")
    p.add_argument("--draft", default="models/code-draft")
    p.add_argument("--head", default="models/code-target-eagle3")
    p.add_argument("--random", default="llama-3.2-1b",
                   help="a random-weight shape for plain decode where it is memory-bound "
                        "('' = none)")
    p.add_argument("--gguf", default=None,
                   help="a catalogue target shipped as GGUF (smollm2-135m-instruct): measure it "
                        "as shipped, as Q8_0 and as BF16 instead of the bundled pair and the "
                        "random shape")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("-k", default="2,3,4", help="the K of speculation, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--publish", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    os.chdir(REPO)
    src = build()
    prompts = PROMPT_SETS["completion"](a.num_prompts)
    ks = [int(k) for k in a.k.split(",")]
    # (model, precision, configuration, side) -> what measures it once, in tokens/s
    runs: dict[tuple[str, str, str, str], Callable[[], float]] = {}
    bundled = f"bundled pair ({a.target}, {a.draft})"
    streamed: dict[tuple, dict] = {}
    bw = memory_bandwidth_gbs()
    quality: dict[str, float] = {}
    if a.gguf:
        runs.update(gguf_runs(a, src, ks, streamed, quality))
    for outtype, (precision, drafter) in ({} if a.gguf else PRECISIONS).items():
        t, d = gguf(src, a.target, outtype), gguf(src, a.draft, outtype)
        specs = {"no speculation": None}
        runs[(bundled, outtype, "no speculation", "llama.cpp")] = functools.partial(
            llama_plain, t, a.tokens, a.threads)
        for k in ks:
            specs[f"draft model (code-draft), K={k}"] = {
                "method": "draft_model", "model": a.draft, "num_speculative_tokens": k, **drafter}
            runs[(bundled, outtype, f"draft model (code-draft), K={k}", "llama.cpp")] = \
                functools.partial(llama_speculative, t, d, prompts, a.tokens, k, a.threads)
        for k in ks:
            specs[f"EAGLE-3 head, K={k} (specserve only)"] = {
                "method": "eagle3", "model": a.head, "num_speculative_tokens": k, **drafter}
        for config, spec in specs.items():
            llm = specserve_engine(a.target, spec, precision, prompts[0])
            runs[(bundled, outtype, config, "specserve")] = functools.partial(
                specserve_decode, llm, prompts, a.tokens, spec is None)
    if a.random and not a.gguf:
        target = resolve("random:" + a.random, a.target)
        name = f"random:{a.random} (memory-bound)"
        for outtype, (precision, _) in PRECISIONS.items():
            runs[(name, outtype, "no speculation", "llama.cpp")] = functools.partial(
                llama_plain, gguf(src, target, outtype), a.tokens, a.threads)
            llm = specserve_engine(target, None, precision, prompts[0])
            runs[(name, outtype, "no speculation", "specserve")] = functools.partial(
                specserve_decode, llm, prompts[:2], a.tokens)
    measured: dict[tuple, list[float]] = {key: [] for key in runs}
    for r in range(a.rounds):
        for key in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            measured[key].append(runs[key]())
    bw = max(bw, memory_bandwidth_gbs())     # the higher of two readings (a shared machine)
    models: dict[str, dict] = {}
    for (model, outtype, config, side), speeds in measured.items():
        v = models.setdefault(model, {}).setdefault(outtype, {}).setdefault(config, {})
        v[side], v[f"{side} rounds"] = statistics.median(speeds), speeds
    # the bandwidth floor: tokens/s if a token cost only reading its weights once
    floors = {f"{model} / {outtype}": {side: bw * 1e9 / b for side, b in by_side.items()}
              for (model, outtype), by_side in streamed.items()}
    data = {"benchmark": "llama-cpp", "title": "specserve against llama.cpp (CPU, same weights)",
            "command": "python benchmarks/llama_cpp.py " + " ".join(sys.argv[1:]),
            "machine": machine(a.threads),
            "llama_cpp": src.parent.parent.name, "threads": a.threads, "k": a.k,
            "rounds": a.rounds,
            "tokens": a.tokens, "num_prompts": a.num_prompts,
            "prompts": "chat (through the chat template)" if a.gguf else "completion",
            "bandwidth_gbs": bw, "floor_tokens_per_s": floors, "models": models,
            "bits_per_byte": quality}
    stem = f"llama-cpp-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out = REPO / "runs" / "llama_cpp"
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(data)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table + "\n")
    plot(data, out / f"{stem}.png")
    print(table)
    if a.publish:
        name = "llama-cpp" + published_suffix(data["machine"]) + (f"-{a.gguf}" if a.gguf else "")
        latest = REPO / "benchmarks" / "latest" / name
        latest.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        latest.with_suffix(".md").write_text(table + "\n")
        plot(data, latest.with_suffix(".png"))
        ratios = "; ".join(f"{name}: " + ", ".join(
            f"{prec} {cfg} {v['specserve'] / v['llama.cpp']:.2f}x"
            for prec, cfgs in rows.items() for cfg, v in cfgs.items()
            if "llama.cpp" in v and "specserve" in v) for name, rows in models.items())
        with (REPO / "benchmarks" / "HISTORY.md").open("a") as f:
            f.write(f"- {data['machine']['date']} · {data['machine']['commit']} · "
                    f"{data['title']} · `{data['command']}` · specserve / llama.cpp: {ratios}\n")

if __name__ == "__main__":
    main()
