"""`specserve bench serve`: HTTP load on a live `specserve serve` per configuration.

For each configuration (no speculation and each method) a server subprocess is started, all of
them before any load; the load generator then runs rounds that visit every configuration at each
concurrency level (closed loop: a client sends its next request when the previous one ends) and
measures output tokens/s (median over rounds), TTFT and time per output token (TPOT)
percentiles. At concurrency 1 the offline engine's TPOT for the
same configuration is measured too, in this process, on the same prompts with the same number
of torch threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import torch

from specserve.bench import report
from specserve.bench.methods import add_common_args, configs, resolve_models
from specserve.bench.probes import machine
from specserve.data.prompts import PROMPT_SETS
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    n = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "e2e": end - t0, "tokens": n,
            "tpot": (end - (first or end)) / max(1, n - 1)}


async def _load(url: str, prompts: list[str], concurrency: int, num_requests: int,
                max_tokens: int) -> tuple[list[dict], int, float]:
    """One closed-loop run: (per-request results, errors, wall seconds)."""
    results: list[dict] = []
    errors = 0
    todo = iter(range(num_requests))

    async def worker(client):
        nonlocal errors
        for i in todo:
            try:
                results.append(await _one(client, url, prompts[i % len(prompts)], max_tokens))
            except httpx.HTTPError:
                errors += 1

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, errors, time.perf_counter() - t0


def _summary(concurrency: int, runs: list[tuple[list[dict], int, float]]) -> dict:
    """Median throughput over rounds; latency percentiles over every request of every round."""
    results = [r for res, _, _ in runs for r in res]
    row = {"concurrency": concurrency, "requests": len(results),
           "errors": sum(e for _, e, _ in runs),
           "output_tokens_per_s": statistics.median(sum(r["tokens"] for r in res) / wall
                                                    for res, _, wall in runs)}
    for key in ("ttft", "tpot"):
        for q in (50, 90, 99):
            row[f"{key}_p{q}_ms"] = 1e3 * _pct([r[key] for r in results], q / 100)
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str, spec: dict | None, port: int, threads: int, dtype: str,
                  device: str):
    cmd = [sys.executable, "-m", "specserve.cli", "serve", model, "--device", device,
           "--dtype", dtype, "--port", str(port), "--served-model-name", "bench",
           "--max-num-seqs", "16"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy in 120 s")


def _offline_tpot_ms(model: str, spec: dict | None, prompts: list[str], max_tokens: int,
                     dtype: str, device: str) -> float:
    """The offline engine's time per output token after the first (the server's TPOT), median
    over `prompts` run one at a time."""
    engine = LLM(model, speculative_config=spec, device=device, dtype=dtype,
                 freeze_gc=True).engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tpots = []
    for p in [prompts[0], *prompts]:             # the first run warms up
        engine.add_request(p, sp)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs:
                first = time.perf_counter()
        n = len(outs[0].outputs[0].token_ids)
        tpots.append((time.perf_counter() - first) / (n - 1))
    return 1e3 * statistics.median(tpots[1:])


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="specserve bench serve", description=__doc__)
    p.add_argument("mode", choices=["serve"])
    add_common_args(p)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds over all configurations (median throughput over rounds)")
    p.add_argument("--prompt-set", default="completion", choices=sorted(PROMPT_SETS))
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="torch threads of the server and of the offline reference (default: "
                        "all CPUs but one, which the load generator on this machine needs)")
    report.add_output_args(p)
    a = p.parse_args(argv)
    target, draft = resolve_models(a)
    torch.set_num_threads(a.threads)
    specs: dict[str, tuple[str, dict | None]] = {"no-spec": (a.target, None)} | configs(a)
    prompts = PROMPT_SETS[a.prompt_set](16)
    concurrencies = [int(x) for x in a.concurrency.split(",")]
    # Offline references first, while no server runs.
    offline = {name: _offline_tpot_ms(model, spec, [prompts[i % len(prompts)] for i in
                                                    range(a.requests_per_client)],
                                      a.max_tokens, a.dtype, a.device)
               for name, (model, spec) in specs.items()}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    runs: dict[tuple[str, int], list] = {(n, c): [] for n in specs for c in concurrencies}
    try:
        for name, (model, spec) in specs.items():
            port = _free_port()
            servers[name] = (_start_server(model, spec, port, a.threads, a.dtype, a.device),
                             f"http://127.0.0.1:{port}")
            asyncio.run(_load(servers[name][1], prompts, 1, 1, 8))          # warm-up
        # Every server stays up; rounds interleave the configurations (rotating their order),
        # so drift of the machine's speed hits all of them alike.
        names = list(specs)
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for c in concurrencies:
                for name in order:
                    runs[(name, c)].append(asyncio.run(_load(
                        servers[name][1], prompts, c, c * a.requests_per_client, a.max_tokens)))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    rows = []
    for (name, c), rs in runs.items():
        row = _summary(c, rs) | {"config": name,
                                 "offline_ms_per_token": offline[name] if c == 1 else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    data = {"benchmark": "serve", "title": "Serving load: `specserve serve` over HTTP",
            "command": "specserve bench " + " ".join(argv), "machine": machine(a.threads, a.device),
            "settings": {"target": target, "draft": draft, "dtype": a.dtype, "device": a.device,
                         "k": a.num_speculative_tokens, "prompt_set": a.prompt_set,
                         "max_tokens": a.max_tokens, "requests_per_client": a.requests_per_client,
                         "rounds": a.rounds, "threads": a.threads,
                         "speculative_config_extra": a.spec_extra},
            "rows": rows}
    print(report.save(data, a.out, a.publish))
