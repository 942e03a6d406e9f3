"""A GPU decode step before and after a change to the model's layers, in one process: the
target's CUDA-graph replay (what the engine's few-row steps run) at batch 1 and 16 and a
5-row verify, alternating the two versions' `RMSNorm.forward` and `Attention._cached` between
rounds (each round re-captures the graphs), with the kernels of one eager decode step of each
(torch's profiler: how many, and their summed GPU time).

    git show COMMIT:specserve/models/layers.py > runs/layers-before.py
    python benchmarks/gpu_step_ab.py runs/layers-before.py [--target random:llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from specserve.bench.gpu import TOKENIZER, target_step_ms
from specserve.bench.random_models import materialize
from specserve.llm import LLM
from specserve.models import layers
from specserve.models.metadata import build_metadata

PATCHED = (("RMSNorm", "forward"), ("Attention", "_cached"))


def versions(before_path: str) -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("layers_before", before_path)
    before = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = before                      # its dataclasses look themselves up
    spec.loader.exec_module(before)
    return {name: {(c, f): getattr(getattr(mod, c), f) for c, f in PATCHED}
            for name, mod in (("before", before), ("after", layers))}


def use(version: dict) -> None:
    for (c, f), fn in version.items():
        setattr(getattr(layers, c), f, fn)


@torch.inference_mode()
def kernels(llm: LLM) -> tuple[int, float]:
    """Kernels of one eager batch-1 decode step at position 100, and their GPU ms."""
    engine = llm.engine
    model, dev = engine.model, engine.device
    md, pos = build_metadata([100], [1], [0], dev)
    ids = torch.tensor([11], device=dev)
    model.compute_logits(model(ids, pos, md, engine.cache.layers))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.compute_logits(model(ids, pos, md, engine.cache.layers))
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(evs), sum(e.device_time_total for e in evs) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="the earlier specserve/models/layers.py")
    p.add_argument("--target", default="random:llama-3.1-8b")
    p.add_argument("--models-root", default="runs/random")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="runs/gpu-step-ab.json")
    a = p.parse_args()
    path = materialize(a.target, TOKENIZER, a.models_root, device="cuda")
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=256)
    cases = [(1, 1), (16, 1), (1, 5)]                    # (batch, rows a request)
    vs = versions(a.before)
    times: dict[str, dict[str, list[float]]] = {v: {f"b{b}r{r}": [] for b, r in cases}
                                                 for v in vs}
    counts = {}
    for _ in range(a.rounds):
        for name, version in vs.items():
            use(version)
            graphs = llm.engine.runner.graphs            # re-captured with this version, into
            graphs.graphs.clear()                        # a new pool (a freed graph's pool
            graphs.pool = torch.cuda.graph_pool_handle()  # cannot take new captures)
            for b, r in cases:
                times[name][f"b{b}r{r}"].append(target_step_ms(llm, b, r, repeats=30))
            counts[name] = kernels(llm)
    result = {"device": torch.cuda.get_device_name(), "target": a.target,
              "torch": torch.__version__, "rounds": a.rounds,
              "replay_ms_median": {v: {c: round(statistics.median(t), 3) for c, t in d.items()}
                                   for v, d in times.items()},
              "replay_ms": times,
              "eager_decode_kernels": {v: {"count": n, "gpu_ms": round(ms, 3)}
                                       for v, (n, ms) in counts.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("replay_ms_median", "eager_decode_kernels")},
                     indent=1))


if __name__ == "__main__":
    main()
