"""`specserve bench latency`: configurations side by side in one process.

For each prompt set and batch size, every configuration (no speculation, each speculation
method, and transformers' generate / assisted generation / prompt lookup on the same models)
runs the same greedy prompts. Rounds alternate the configuration order; the report gives the
median tokens/s over rounds, the speedup over specserve without speculation, tau and
per-position acceptance. Results are appended to benchmarks/RESULTS.md with a PNG plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.bench.methods import add_common_args, configs
from specserve.data.prompts import PROMPT_SETS
from specserve.inputs import TokensPrompt
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.token_tree import TokenTree


@dataclass
class Result:
    name: str
    tokens_per_s: list[float] = field(default_factory=list)
    # per round, the median over requests of (finish - first token) / (tokens - 1): decode
    # alone, as vLLM's TPOT (tokens/s above include each prompt's prefill)
    tpot_ms: list[float] = field(default_factory=list)
    tau: float | None = None
    acceptance_rate: float | None = None
    per_pos: list[float] | None = None
    same_output: str | None = None      # prompts whose greedy tokens equal no-spec's, "7/8"
    note: str | None = None             # what the runner reports beside its name (`note()`)

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def tpot(self) -> float | None:
        return statistics.median(self.tpot_ms) if self.tpot_ms else None


def memory_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth measured by summing a large float32 tensor (best of `repeats`)."""
    x = torch.ones(mb * 1024 * 1024 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def greedy_seconds(llm, n: int) -> float:
    """Wall time of one batch-1 greedy request of `n` new tokens after a 64-token prompt."""
    t = time.perf_counter()
    llm.generate(TokensPrompt(prompt_token_ids=list(range(10, 74))),
                 SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def prompt_ms(llm, n: int, repeats: int = 5) -> float:
    """Batch-1 time to the first token of an `n`-token prompt (median of repeats, in ms): the
    prompt's forward (its chunks, a drafter's pass over it) and one sampled token."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=[10 + i % 64 for i in range(n)])
    times = []
    for _ in range(repeats + 1):                          # the first run warms up
        t = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def decode_ms_per_token(llm, tokens: int = 128, repeats: int = 5) -> float:
    """Batch-1 greedy decode time per token without the prompt's cost: the median over
    repeats of (time for `tokens` tokens - time for 1 token) / (tokens - 1), 64-token prompt."""
    greedy_seconds(llm, 8)
    return statistics.median((greedy_seconds(llm, tokens) - greedy_seconds(llm, 1))
                             / (tokens - 1) for _ in range(repeats)) * 1e3


def cpu_name() -> str:
    """The CPU's model name (runs on different machines are not comparable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def weight_bytes(model: torch.nn.Module, streamed: bool = False) -> int:
    """Bytes of the weights a decode step reads: every weight except the input embedding table
    (only one row of it is read per token) unless it doubles as the lm_head. `streamed`: as
    the CPU kernel stores them (bfloat16-valued weights packed in bfloat16), else as the
    model's parameters."""
    packed = {id(m.weight): m.kernel_weight for m in model.modules()
              if getattr(m, "kernel_weight", None) is not None} if streamed else {}
    total = sum(packed[id(p)].element_size() * p.numel() if id(p) in packed
                else p.numel() * p.element_size() for p in model.parameters())
    if not model.args.tie_word_embeddings:
        e = model.embed_tokens.weight
        total -= e.numel() * e.element_size()
    return total


class SpecserveRunner:
    def __init__(self, name: str, target: str, spec: dict | None, dtype: str,
                 cpu_kernel: bool = True) -> None:
        self.name = name
        self.llm = LLM(target, speculative_config=spec, dtype=dtype, device="cpu", freeze_gc=True,
                       max_num_seqs=16, max_num_batched_tokens=2048, cpu_kernel=cpu_kernel)
        self.spec, self.dtype = spec, dtype
        self.tpots: list[float] = []        # ms per decoded token of each request this round

    def run(self, prompts: list[str], max_tokens: int, temperature: float = 0.0
            ) -> list[list[int]]:
        """Output token ids of each prompt (seeded per prompt when sampling)."""
        sp = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                             ignore_eos=True) for i in range(len(prompts))]
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > 1:
                self.tpots.append(1e3 * (o.metrics["finish_time"] - o.metrics["first_token_time"])
                                  / (n - 1))
        return [o.outputs[0].token_ids for o in outs]

    def tpot_ms(self) -> float | None:
        """The median time per output token after the first over this round's requests."""
        return statistics.median(self.tpots) if self.tpots else None

    def new_round(self) -> None:
        """Forget what earlier rounds taught the drafter (suffix's past responses: the same
        prompts come again)."""
        self.tpots.clear()
        self.llm.engine.reset_proposer()

    def acceptance(self) -> tuple[float, float, list[float]] | None:
        if self.spec is None:
            return None
        m = self.llm.get_metrics()
        d = max(1, m["spec_decode_num_drafts"])
        return (m["mean_acceptance_length"], m["acceptance_rate"],
                [a / d for a in m["spec_decode_num_accepted_tokens_per_pos"]])

    def note(self) -> str | None:
        """adaptive_k: the mean K over the steps it chose; hybrid_prompt_lookup: the share of
        drafts that prompt lookup made."""
        m, notes = self.llm.get_metrics(), []
        choices = m.get("adaptive_k_choices")
        if choices:
            mean = sum(k * n for k, n in choices.items()) / sum(choices.values())
            notes.append(f"adaptive: mean K {mean:.1f}")
        lookups = m.get("num_lookup_drafts")
        if lookups is not None:
            notes.append(f"lookup drafted {lookups / max(1, m['spec_decode_num_drafts']):.0%}")
        return ", ".join(notes) or None


class TransformersRunner:
    """transformers generate(), assisted generation or prompt lookup (batch 1 only)."""

    def __init__(self, name: str, target: str, draft: str | None, prompt_lookup: int | None,
                 dtype: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        dt = getattr(torch, dtype)
        self.name, self.dtype = name, dtype
        self.tok = AutoTokenizer.from_pretrained(target)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dt).eval()
        self.kw: dict = {}
        if draft:
            self.kw["assistant_model"] = AutoModelForCausalLM.from_pretrained(draft, dtype=dt).eval()
        if prompt_lookup:
            self.kw["prompt_lookup_num_tokens"] = prompt_lookup

    @torch.inference_mode()
    def run(self, prompts: list[str], max_tokens: int, temperature: float = 0.0
            ) -> list[list[int]]:
        outs = []
        sample = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {
            "do_sample": False}
        for p in prompts:
            ids = torch.tensor([self.tok(p)["input_ids"]])
            out = self.model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      pad_token_id=self.tok.eos_token_id, **sample, **self.kw)
            outs.append(out[0, ids.shape[1]:].tolist())
        return outs

    def new_round(self) -> None:
        pass

    def tpot_ms(self) -> None:
        return None                         # generate() reports no per-token times

    def acceptance(self):
        return None

    def note(self):
        return None


def run_suite(runners, prompts: list[str], batch: int, max_tokens: int, rounds: int,
              temperature: float = 0.0) -> list[Result]:
    """Runs every runner on every prompt group per round; greedy outputs (not when sampling)
    are compared with those of the first runner of the same dtype (the dtype's no-spec)."""
    results = {r.name: Result(r.name) for r in runners}
    outputs: dict[str, list[list[int]]] = {}
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for r in runners:                                   # warm-up
        r.run(prompts[:1], 8)
    for rnd in range(rounds):
        order = runners if rnd % 2 == 0 else runners[::-1]
        for r in order:
            if isinstance(r, TransformersRunner) and batch > 1:
                continue
            r.new_round()
            t = time.perf_counter()
            outputs[r.name] = [ids for g in groups for ids in r.run(g, max_tokens, temperature)]
            n = sum(len(ids) for ids in outputs[r.name])
            results[r.name].tokens_per_s.append(n / (time.perf_counter() - t))
            if (tpot := r.tpot_ms()) is not None:
                results[r.name].tpot_ms.append(tpot)
    first = {}
    for r in runners:
        first.setdefault(r.dtype, r.name)
    for r in runners:
        if not temperature and r.name in outputs:
            ref = outputs[first[r.dtype]]
            same = sum(a == b for a, b in zip(outputs[r.name], ref))
            results[r.name].same_output = f"{same}/{len(ref)}"
    for r in runners:
        acc = r.acceptance()
        if acc:
            results[r.name].tau, results[r.name].acceptance_rate, results[r.name].per_pos = acc
        results[r.name].note = r.note()
    return [res for res in results.values() if res.tokens_per_s]


def _table(results: list[Result], base: str) -> str:
    ref = next(r for r in results if r.name == base)
    rows = ["| configuration | tokens/s (median) | speedup vs no-spec | TPOT ms (median) "
            "| decode speedup | tau | acceptance rate | per-position acceptance "
            "| greedy output = no-spec |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        pp = "" if r.per_pos is None else ", ".join(f"{x:.2f}" for x in r.per_pos)
        name = r.name if r.note is None else f"{r.name}, {r.note}"
        tpot = "" if r.tpot is None else f"{r.tpot:.2f}"
        decode = f"{ref.tpot / r.tpot:.2f}x" if r.tpot and ref.tpot else ""
        rows.append(f"| {name} | {r.median:.1f} | {r.median / ref.median:.2f}x | {tpot} | "
                    f"{decode} | "
                    f"{'' if r.tau is None else f'{r.tau:.2f}'} | "
                    f"{'' if r.acceptance_rate is None else f'{r.acceptance_rate:.1%}'} | {pp} | "
                    f"{r.same_output or ''} |")
    return "\n".join(rows)


def _plot(all_results: dict[str, list[Result]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(all_results), figsize=(5 * len(all_results), 4), squeeze=False)
    for ax, (title, results) in zip(axes[0], all_results.items()):
        ax.barh([r.name for r in results], [r.median for r in results], color="C0")
        ax.set_title(title)
        ax.set_xlabel("tokens/s (median)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _floor_ratios(name: str, ms: float, wb: int, streamed: int, bw: float) -> str:
    """A decode time per token against the bandwidth floor (and against the floor of the
    bytes the CPU kernel streams, for the run that uses it)."""
    text = f"{name} {ms:.2f} ms/token = {ms / (wb / bw / 1e6):.2f}x the floor"
    if streamed != wb and "PyTorch path" not in name:
        text += f", {ms / (streamed / bw / 1e6):.2f}x the floor of the bytes it streams"
    return text


def _k_label(spec: dict) -> str:
    if spec.get("speculative_token_tree"):
        return f"tree of {len(TokenTree.parse(spec['speculative_token_tree']))}"
    label = f"K={spec['num_speculative_tokens']}"
    if spec.get("draft_confidence_threshold"):
        label += f", conf >= {spec['draft_confidence_threshold']:g}"
    return label


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="specserve bench latency", description=__doc__)
    p.add_argument("mode", choices=["latency"])
    add_common_args(p)
    p.add_argument("--prompt-sets", default="completion,editing")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (outputs compared with no-spec); > 0 samples, seeded per prompt")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers peers")
    p.add_argument("--pytorch-path", action="store_true",
                   help="also run no-spec without the compiled CPU kernel (cpu_kernel=False)")
    p.add_argument("--title", default="Offline latency: specserve methods and transformers")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    K = a.num_speculative_tokens
    specs = configs(a)
    dtypes = a.dtype.split(",")
    dtype = dtypes[0]
    all_results: dict[str, list[Result]] = {}
    bw = memory_bandwidth_gbs()
    for set_name in a.prompt_sets.split(","):
        prompts = PROMPT_SETS[set_name](a.num_prompts)
        for batch in [int(b) for b in a.batch_sizes.split(",")]:
            # Fresh engines per suite so acceptance statistics belong to this suite only.
            runners = [SpecserveRunner("specserve no-spec", a.target, None, dtype)]
            if a.pytorch_path:
                runners.append(SpecserveRunner("specserve no-spec, PyTorch path", a.target,
                                               None, dtype, cpu_kernel=False))
            for d in dtypes:                  # the first dtype unnamed; each further one named
                tag = "" if d == dtype else f", {d}"
                if tag:
                    runners.append(SpecserveRunner(f"specserve no-spec{tag}", a.target, None, d))
                runners += [SpecserveRunner(f"specserve {m} ({_k_label(spec)}){tag}", model, spec,
                                            d) for m, (model, spec) in specs.items()]
            if not a.no_transformers and batch == 1:
                runners += [TransformersRunner("transformers generate()", a.target, None, None,
                                               dtype),
                            TransformersRunner("transformers assisted (draft, K dynamic)",
                                               a.target, a.draft, None, dtype),
                            TransformersRunner(f"transformers prompt lookup ({K})", a.target,
                                               None, K, dtype)]
            key = f"{set_name}, batch {batch}"
            print(f"== {key}", flush=True)
            all_results[key] = run_suite(runners, prompts, batch, a.max_tokens, a.rounds,
                                         a.temperature)
            print(_table(all_results[key], "specserve no-spec"), flush=True)
    # Decode alone against the bandwidth floor (tokens/s above include the prompts' prefill).
    floor_runners = [SpecserveRunner("specserve no-spec", a.target, None, dtype)]
    if a.pytorch_path:
        floor_runners.append(SpecserveRunner("specserve no-spec, PyTorch path", a.target, None,
                                             dtype, cpu_kernel=False))
    floor_runners += [SpecserveRunner(f"specserve no-spec, {d}", a.target, None, d)
                      for d in dtypes[1:]]
    decode = {r.name: decode_ms_per_token(r.llm) for r in floor_runners}
    lengths = [n for n in (64, 256, 512)
               if n < floor_runners[0].llm.engine.max_model_len]
    prefill = {r.name: [prompt_ms(r.llm, n) for n in lengths] for r in floor_runners}
    target_model = floor_runners[0].llm.engine.model
    wb, streamed = weight_bytes(target_model), weight_bytes(target_model, streamed=True)
    # Measured again at the end, the higher reading kept: on a shared machine one reading can
    # come out at half the rate of the next, which would halve the floor's strictness.
    bw = max(bw, memory_bandwidth_gbs())
    cmd = "specserve bench " + " ".join(argv)
    out = Path(a.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.parent / f"latency-{datetime.datetime.now():%Y-%m-%d-%H%M%S}.png"
    _plot(all_results, png)
    lines = [f"\n## {a.title}\n",
             f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, "
             f"{torch.get_num_threads()} torch threads, {cpu_name()}; "
             f"torch {torch.__version__}",
             f"- command: `{cmd}`",
             f"- target {a.target}, draft {a.draft}, dtype {a.dtype}, "
             f"{'greedy' if not a.temperature else f'temperature {a.temperature}'}, "
             f"speculative_config extra: {a.spec_extra or 'none'}, "
             f"{a.num_prompts} prompts x {a.max_tokens} new tokens, median of {a.rounds} rounds",
             f"- measured read bandwidth {bw:.1f} GB/s; target weights streamed per step "
             f"{wb / 1e6:.1f} MB -> bandwidth floor {wb / bw / 1e6:.2f} ms/token"
             + (f" (the CPU kernel streams them as {streamed / 1e6:.1f} MB: floor "
                f"{streamed / bw / 1e6:.2f} ms/token)" if streamed != wb else ""),
             "- batch-1 greedy decode alone (128 tokens after a 64-token prompt, prompt time "
             "taken out, median of 5): " + "; ".join(
                 _floor_ratios(name, ms, wb, streamed, bw) for name, ms in decode.items()),
             f"- batch-1 time to the first token of a {' / '.join(map(str, lengths))}-token "
             "prompt (median of 5): " + "; ".join(
                 f"{name} {' / '.join(f'{ms:.1f}' for ms in times)} ms"
                 for name, times in prefill.items()),
             f"- plot: {png.name}", ""]
    for key, results in all_results.items():
        lines += [f"### {key}\n", _table(results, "specserve no-spec"), ""]
    with open(out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(json.dumps({"results": str(out), "plot": str(png)}))
