"""`specserve bench gpu`: the GPU check's benchmark (benchmarks/gpu_check.sh runs it).

A random-weight model of a real shape (Llama-3.1-8B by default, built on the GPU in seconds)
decodes at batch 1 and 16 without speculation, with an EAGLE-3 head and with a 1B-shape
draft model, acceptance synthetic (their text is noise, so a rate is imposed: the cost of
drafting and verifying is real, the acceptance is the one asked for), beside transformers'
`generate` on the same weights (plain, and assisted by the draft at batch 1, the only batch
assisted generation takes). Each row: tokens/s over the batch (median of rounds, prompts'
prefill included), ms per token of one sequence, tau, and the floor: the bytes of weights one
step reads over the copy bandwidth measured in the same run. Writes gpu.json and gpu.md to
--out (`--publish`, or `specserve bench report gpu.json --publish` where the run came from a
GPU host: benchmarks/latest/gpu.*). `--dry-run`: tiny shapes in float32 on the CPU, so that
the command cannot rot between GPU runs (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from specserve.bench import report
from specserve.bench.probes import (
    _sync,
    copy_bandwidth_gbs,
    git_commit,
    machine,
    step_ms,
    weight_bytes,
)
from specserve.bench.random_models import materialize, random_heads
from specserve.data.zoo import head_dir
from specserve.inputs import TokensPrompt
from specserve.llm import LLM
from specserve.models.backend import release_freed_memory
from specserve.sampling_params import SamplingParams

TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "code-target"
DRY_TARGET = "random:hidden=64,layers=2,inter=128,heads=4,kv=2,vocab=9000"
DRY_DRAFT = "random:hidden=32,layers=1,inter=64,heads=4,kv=2,vocab=9000"
PROMPT_LEN = 32
FIELDS = ("model", "engine", "method", "k", "batch", "dtype", "tokens_per_s", "ms_per_token",
          "tau", "floor_ms_per_token")


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(10, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def _free() -> None:
    gc.collect()
    release_freed_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def specserve_rows(name: str, target: str, spec: dict | None, method: str, a) -> list[dict]:
    """One engine, every batch size: warm-up (CUDA graphs captured), then `a.rounds` timed
    rounds each."""
    llm = LLM(target, device=a.device, dtype=a.dtype, speculative_config=spec,
              max_num_seqs=max(a.batch_sizes), max_model_len=PROMPT_LEN + a.max_tokens + 16,
              max_num_batched_tokens=max(2048, PROMPT_LEN * max(a.batch_sizes)))
    floor = weight_bytes(llm.engine.model) / a.bandwidth / 1e6          # ms per step
    vocab = min(llm.engine.model.args.vocab_size, a.tokenizer_vocab)
    print(f"  backend: {llm.engine.backend_line}", flush=True)
    rows = []
    for batch in a.batch_sizes:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(batch, vocab)]
        params = [SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True,
                                 seed=i) for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)                   # warm-up
        before = llm.get_stats() if spec else None
        rates = []
        for _ in range(a.rounds):
            llm.reset_prefix_cache()
            _sync(torch.device(a.device))
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates.append(batch * a.max_tokens / (time.perf_counter() - t))
        tau = None
        if spec:
            m = llm.get_stats()
            drafts = m["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            accepted = (m["spec_decode_num_accepted_tokens"]
                        - before["spec_decode_num_accepted_tokens"])
            tau = round(1 + accepted / max(1, drafts), 3)
        rows.append(_row(name, "specserve", method, spec and spec["num_speculative_tokens"],
                         batch, a.dtype, rates, tau, floor))
        if spec is None:
            rows[-1]["target_step_ms"] = round(target_step_ms(llm, batch), 3)
        if a.profile and batch == 1:
            _profile(llm, prompts, params, Path(a.out) / f"profile-{method}.txt")
        print(f"  {rows[-1]}", flush=True)
    del llm
    _free()
    return rows


def target_step_ms(llm: LLM, batch: int, rows: int = 1, repeats: int = 20) -> float:
    """One step of the target alone for `batch` requests of `rows` new tokens each at position
    100 (or the cache's last): its CUDA graph's replay, inputs and outputs included, where the
    engine has graphs, else the eager step. What the engine's step costs beyond it is its own
    work."""
    runner = llm.engine.runner
    pos = min(100, runner.cache.max_len - 1 - rows)
    if runner.graphs is None:
        return step_ms(llm, rows, pos, repeats, batch)
    dev, slots, times = torch.device(llm.engine.device), list(range(batch)), []
    with torch.inference_mode():
        for _ in range(repeats + 1):                      # the first run warms up
            _sync(dev)
            t = time.perf_counter()
            runner.graphs.run([11] * rows * batch, [pos] * batch, [rows] * batch, slots)
            _sync(dev)
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def _profile(llm: LLM, prompts, params, path: Path) -> None:
    """The host's time per Python function over one batch-1 generation (cProfile: time spent
    waiting for the GPU shows in the calls that sync, `tolist`), where an engine step's time
    goes beyond the target's own."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.runcall(llm.generate, prompts, params, use_tqdm=False)
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(35)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())


def _row(model: str, engine: str, method: str, k: int | None, batch: int, dtype: str,
         rates: list[float], tau: float | None, floor: float) -> dict:
    tps = statistics.median(rates)
    return {"model": model, "engine": engine, "method": method, "k": k, "batch": batch,
            "dtype": dtype, "tokens_per_s": round(tps, 1),
            "ms_per_token": round(1e3 * batch / tps, 3), "tau": tau,
            "floor_ms_per_token": round(floor, 3), "rounds_tokens_per_s": [round(r, 1)
                                                                            for r in rates]}


@torch.inference_mode()
def transformers_rows(name: str, target: str, draft: str, a) -> list[dict]:
    """transformers' generate on the same weights: plain at every batch size, assisted by
    the draft at batch 1 (K draft tokens a step, constant)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("  transformers is not installed: its rows are left out", flush=True)
        return []
    dt, dev = getattr(torch, a.dtype), torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dt).to(dev).eval()
    floor = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if "embed_tokens" not in n) / a.bandwidth / 1e6
    vocab = min(model.config.vocab_size, a.tokenizer_vocab)
    assistant = None
    rows = []
    for method, batches in (("none", a.batch_sizes), ("draft_model", [1])):
        kw: dict = {}
        if method == "draft_model":
            assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=dt).to(dev).eval()
            assistant.generation_config.num_assistant_tokens = a.k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            kw["assistant_model"] = assistant
        for batch in batches:
            ids = torch.tensor(_prompts(batch, vocab), device=dev)
            gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=a.max_tokens,
                       min_new_tokens=a.max_tokens, do_sample=False, pad_token_id=0, **kw)
            model.generate(ids, **(gen | {"max_new_tokens": 8, "min_new_tokens": 8}))  # warm-up
            rates = []
            for _ in range(a.rounds):
                _sync(dev)
                t = time.perf_counter()
                out = model.generate(ids, **gen)
                _sync(dev)
                rates.append((out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - t))
            rows.append(_row(name, "transformers", method, a.k if assistant else None, batch,
                             a.dtype, rates, None, floor))
            print(f"  {rows[-1]}", flush=True)
    del model, assistant
    _free()
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="specserve bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes in float32 on the CPU (checks the command, no figures)")
    p.add_argument("--target", default="random:llama-3.1-8b")
    p.add_argument("--draft", default="random:llama-3.2-1b-v128k")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--acceptance", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models-root", default="runs/random",
                   help="where the random models are built (a RAM disk saves minutes)")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also write each engine's batch-1 operator profile to the out directory")
    report.add_output_args(p)
    a = p.parse_args(argv[1:])
    if a.dry_run:
        a.device, a.dtype = "cpu", "float32"
        a.target, a.draft = DRY_TARGET, DRY_DRAFT
    else:
        if not torch.cuda.is_available():
            raise SystemExit("specserve bench gpu needs a CUDA device (or --dry-run)")
        a.device, a.dtype = "cuda", "bfloat16"
    a.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    a.tokenizer_vocab = json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]
    dev = torch.device(a.device)
    a.bandwidth = copy_bandwidth_gbs(dev, 64 if a.dry_run else 1024)
    t0 = time.perf_counter()
    target = materialize(a.target, TOKENIZER, a.models_root, device=a.device)
    random_heads(target, names=("eagle3",), device=a.device)
    draft = materialize(a.draft, TOKENIZER, a.models_root, device=a.device)
    _free()
    print(f"models built in {time.perf_counter() - t0:.0f} s; copy bandwidth "
          f"{a.bandwidth:.0f} GB/s", flush=True)
    name = a.target.removeprefix("random:")
    synthetic = {"num_speculative_tokens": a.k, "rejection_sample_method": "synthetic",
                 "synthetic_acceptance_rate": a.acceptance}
    rows = []
    for method, spec in (("none", None),
                         ("eagle3", synthetic | {"method": "eagle3",
                                                 "model": head_dir(target, "eagle3")}),
                         ("draft_model", synthetic | {"method": "draft_model",
                                                      "model": draft})):
        print(f"specserve {method}", flush=True)
        rows += specserve_rows(name, target, spec, method, a)
    if not a.no_transformers:
        print("transformers", flush=True)
        rows += transformers_rows(name, target, draft, a)
    m = machine(device=a.device)
    data = {"benchmark": "gpu", "published_name": "gpu",
            "title": f"GPU check: {name}, random weights, beside transformers",
            "device": m.get("gpu", m["cpu"]), "date": m["date"], "commit": git_commit(),
            "command": "specserve bench gpu " + " ".join(argv[1:]), "machine": m,
            "copy_bandwidth_gbs": round(a.bandwidth, 1), "acceptance": a.acceptance,
            "prompt_tokens": PROMPT_LEN, "max_tokens": a.max_tokens, "rounds": a.rounds,
            "dry_run": a.dry_run, "rows": rows}
    paths = report.save(data, a.out, a.publish, stem="gpu")
    print(report.markdown(data))
    print(json.dumps(paths))
