"""`specserve bench latency`: configurations side by side in one process.

For each prompt set and batch size, every configuration (no speculation, each speculation
method, and transformers' generate / assisted generation / prompt lookup on the same models)
runs the same greedy prompts. Rounds alternate the configuration order; the report gives the
median tokens/s over rounds, the speedup over specserve without speculation, tau and
per-position acceptance, and whether greedy output equals no-spec's. A run writes one JSON
(the source of truth) with its Markdown table and PNG plot (`bench/report.py`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import time

import torch

from specserve.bench import report
from specserve.bench.methods import add_common_args, configs, prompt_set, resolve_models
from specserve.bench.probes import (
    decode_against_read,
    machine,
    memory_bandwidth_gbs,
    prompt_ms,
    step_ms,
    weight_bytes,
)
from specserve.bench.runners import Result, SpecserveRunner, TransformersRunner
from specserve.methods import resolve_speculative_config
from specserve.models.catalogue import resolve_model
from specserve.token_tree import TokenTree


def run_suite(runners, prompts: list[str], batch: int, max_tokens: int, rounds: int,
              temperature: float = 0.0) -> list[Result]:
    """Runs every runner on every prompt group per round, the runners in turn on each group
    (their order reversed from group to group and round to round), so that a machine whose
    speed drifts over seconds slows every configuration alike; greedy outputs (not when
    sampling) are compared with those of the first runner of the same dtype (the dtype's
    no-spec)."""
    results = {r.name: Result(r.name) for r in runners}
    outputs: dict[str, list[list[int]]] = {}
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for r in runners:                                   # warm-up
        r.run(prompts[:1], 8)
    turn = [r for r in runners if not (isinstance(r, TransformersRunner) and batch > 1)]
    for rnd in range(rounds):
        spent = {r.name: 0.0 for r in turn}
        for r in turn:
            r.new_round()
            outputs[r.name] = []
        for j, g in enumerate(groups):
            for r in turn if (rnd + j) % 2 == 0 else turn[::-1]:
                t = time.perf_counter()
                outputs[r.name] += r.run(g, max_tokens, temperature, j * batch)
                spent[r.name] += time.perf_counter() - t
        for r in turn:
            n = sum(len(ids) for ids in outputs[r.name])
            results[r.name].tokens_per_s.append(n / spent[r.name])
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
            res = results[r.name]
            res.tau, res.acceptance_rate, res.per_pos, res.draft_ms = acc
        results[r.name].note = r.note()
        results[r.name].resident_mb = getattr(r, "resident_mb", None)
    return [res for res in results.values() if res.tokens_per_s]


def draft_used(draft: str, specs: dict[str, tuple[str, dict]], transformers: bool) -> bool:
    """Whether a run loads --draft (or its PARD draft), so that its record names it: a run
    whose drafters all come from METHOD@DIR or the catalogue named a toy draft it never ran."""
    return transformers or any(str(spec.get("model", "")).startswith(draft)
                               for _, spec in specs.values())


def _k_label(spec: dict, target: str) -> str:
    if spec.get("speculative_token_tree"):
        return f"tree of {len(TokenTree.parse(spec['speculative_token_tree']))}"
    if spec.get("method") == "auto":     # its K and threshold as it settles them for target
        config = resolve_speculative_config(spec, resolve_model(target))
        label, conf = f"K<={config.num_speculative_tokens}", config.draft_confidence_threshold
    else:
        label, conf = f"K={spec['num_speculative_tokens']}", spec.get("draft_confidence_threshold")
    return label + (f", conf >= {conf:g}" if conf else "")


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
    p.add_argument("--eager", action="store_true",
                   help="also run no-spec without CUDA graphs (enforce_eager; --device cuda)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1: also run no-spec with the target split over N ranks (one process "
                        "each, the threads shared out), beside one rank")
    p.add_argument("--title", default="Offline latency: specserve methods and transformers")
    p.add_argument("--published-name", default=None,
                   help="name under benchmarks/latest/ (default: latency, the device and the "
                        "target): a run of another workload beside the main one")
    report.add_output_args(p)
    a = p.parse_args(argv)
    target, draft = resolve_models(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    K = a.num_speculative_tokens
    specs = configs(a)
    dtypes = a.dtype.split(",")
    dtype = dtypes[0]
    all_results: dict[str, list[Result]] = {}
    dev = a.device
    batches = [int(b) for b in a.batch_sizes.split(",")]
    # KV slots for the largest batch only: a 1B target's 16 slots of 1024 positions take 1 GB
    Runner = functools.partial(SpecserveRunner, max_num_seqs=max(batches))
    bw = memory_bandwidth_gbs(dev)
    names = {m: f"specserve {m} ({_k_label(spec, model)})" for m, (model, spec) in specs.items()}
    for set_name in a.prompt_sets.split(","):
        prompts = prompt_set(set_name, a.num_prompts, a.target)
        for batch in batches:
            # Fresh engines per suite so acceptance statistics belong to this suite only.
            runners = [Runner("specserve no-spec", a.target, None, dtype, device=dev)]
            if a.pytorch_path:
                runners.append(Runner("specserve no-spec, PyTorch path", a.target,
                                               None, dtype, cpu_kernel=False, device=dev))
            if a.eager:
                runners.append(Runner("specserve no-spec, eager", a.target, None, dtype,
                                               device=dev, enforce_eager=True))
            if a.tensor_parallel_size > 1:
                tp = a.tensor_parallel_size
                runners.append(Runner(f"specserve no-spec, tensor parallel {tp}",
                                               a.target, None, dtype, device=dev,
                                               tensor_parallel_size=tp))
            for d in dtypes:                  # the first dtype unnamed; each further one named
                tag = "" if d == dtype else f", {d}"
                if tag:
                    runners.append(Runner(f"specserve no-spec{tag}", a.target, None, d,
                                                   device=dev))
                runners += [Runner(f"{names[m]}{tag}", model, spec, d, device=dev)
                            for m, (model, spec) in specs.items()]
            if not a.no_transformers and batch == 1:
                # no quantized weights there
                dtype_hf = dtype if dtype in ("float32", "bfloat16") else "bfloat16"
                runners += [TransformersRunner("transformers generate()", a.target, None, None,
                                               dtype_hf, dev),
                            TransformersRunner("transformers assisted (draft, K dynamic)",
                                               a.target, a.draft, None, dtype_hf, dev),
                            TransformersRunner(f"transformers prompt lookup ({K})", a.target,
                                               None, K, dtype_hf, dev)]
            key = f"{set_name}, batch {batch}"
            print(f"== {key}", flush=True)
            all_results[key] = run_suite(runners, prompts, batch, a.max_tokens, a.rounds,
                                         a.temperature)
            print(report.latency_table([r.as_dict() for r in all_results[key]], dtypes),
                  flush=True)
            for r in runners:           # free their engines before the next ones load
                engine = getattr(getattr(r, "llm", None), "engine", None)
                if engine is not None:
                    engine.close()
            del runners
            gc.collect()
    # Decode alone against the bandwidth floor (tokens/s above include the prompts' prefill).
    floor_runners = [Runner("specserve no-spec", a.target, None, dtype, device=dev)]
    if a.pytorch_path:
        floor_runners.append(Runner("specserve no-spec, PyTorch path", a.target, None,
                                             dtype, cpu_kernel=False, device=dev))
    floor_runners += [Runner(f"specserve no-spec, {d}", a.target, None, d, device=dev)
                      for d in dtypes[1:]]
    against = {r.name: decode_against_read(r.llm) for r in floor_runners}
    resident = {r.name: r.resident_mb for r in floor_runners}
    step_rows = [1, 2, 4, 5, 8, 16]
    steps = {r.name: [step_ms(r.llm, n) for n in step_rows] for r in floor_runners}
    streamed_by = {r.name: weight_bytes(r.llm.engine.model, streamed=True) for r in floor_runners}
    lengths = [n for n in (64, 256, 512)
               if n < floor_runners[0].llm.engine.max_model_len]
    prefill = {r.name: [prompt_ms(r.llm, n) for n in lengths] for r in floor_runners}
    target_model = floor_runners[0].llm.engine.model
    wb, streamed = weight_bytes(target_model), weight_bytes(target_model, streamed=True)
    # Measured again at the end, the higher reading kept: on a shared machine one reading can
    # come out at half the rate of the next, which would halve the floor's strictness.
    bw = max(bw, memory_bandwidth_gbs(dev))
    uses_draft = draft_used(a.draft, specs, not a.no_transformers and 1 in batches)
    data = {"benchmark": "latency", "title": a.title,
            "command": "specserve bench " + " ".join(argv), "machine": machine(device=dev),
            "settings": {"target": target, "draft": draft if uses_draft else None,
                         "dtypes": dtypes, "device": dev,
                         "temperature": a.temperature, "num_prompts": a.num_prompts,
                         "max_tokens": a.max_tokens, "rounds": a.rounds,
                         "speculative_config_extra": a.spec_extra,
                         "configs": {m: spec for m, (_, spec) in specs.items()}},
            "bandwidth_gbs": bw, "weight_bytes": wb, "weight_bytes_streamed": streamed,
            "decode_ms_per_token": {n: v["decode_ms"] for n, v in against.items()},
            "weights_read_ms": {n: v["read_ms"] for n, v in against.items()},
            "decode_over_read": {n: v["over_read"] for n, v in against.items()},
            "resident_mb": resident,
            "weight_bytes_streamed_by_config": streamed_by,
            "step_ms": {"rows": step_rows, "by_config": steps},
            "prompt_ms": {"lengths": lengths, "by_config": prefill},
            "suites": {key: [r.as_dict() for r in results]
                       for key, results in all_results.items()}}
    if a.published_name:
        data["published_name"] = a.published_name
    print(report.save(data, a.out, a.publish))
