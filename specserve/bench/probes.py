"""What a benchmark records about the machine and the model: bandwidth, CPU, commit, decode and
prompt timings, the bytes a decode step reads."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specserve.inputs import TokensPrompt
from specserve.kernels.cpu import cpu_flags, load_library, read_once
from specserve.llm import LLM
from specserve.models.metadata import build_metadata
from specserve.sampling_params import SamplingParams


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux's VmRSS), or None where it cannot be read."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in status.splitlines() if ln.startswith("VmRSS:")), None)
    return None if line is None else int(line.split()[1]) * 1024


def memory_bandwidth_gbs(device: str = "cpu", mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth of `device` measured by summing a large float32 tensor (best of
    `repeats`; 4x the size on a GPU, whose caches hold far more)."""
    dev = torch.device(device)
    x = torch.ones((mb if dev.type == "cpu" else 4 * mb) * 1024 * 1024 // 4, device=dev)
    best = float("inf")
    for _ in range(repeats + 1):                      # the first run warms up
        _sync(dev)
        t = time.perf_counter()
        x.sum()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def copy_bandwidth_gbs(device: torch.device, mb: int = 1024, repeats: int = 5) -> float:
    """Bytes read and written per second by a device-to-device copy of `mb` MB (best of
    repeats): the rate a decode step's weight reads can reach at best."""
    x = torch.ones(mb * 1024 * 1024 // 4, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(repeats + 1):                      # the first run warms up
        _sync(device)
        t = time.perf_counter()
        y.copy_(x)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_seconds(llm: LLM, n: int) -> float:
    """Wall time of one batch-1 greedy request of `n` new tokens after a 64-token prompt."""
    llm.reset_prefix_cache()                  # the prompt is computed every time
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
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def _decode_ms(llm, tokens: int) -> float:
    return (greedy_seconds(llm, tokens) - greedy_seconds(llm, 1)) / (tokens - 1) * 1e3


def decode_ms_per_token(llm, tokens: int = 128, repeats: int = 5) -> float:
    """Batch-1 greedy decode time per token without the prompt's cost: the median over
    repeats of (time for `tokens` tokens - time for 1 token) / (tokens - 1), 64-token prompt."""
    greedy_seconds(llm, 8)
    return statistics.median(_decode_ms(llm, tokens) for _ in range(repeats))


def weights_read_ms(model: torch.nn.Module, repeats: int = 5) -> float | None:
    """Median ms to read once, doing nothing else, the weights the CPU kernel streams in a
    decode step (`read_once`; the norms' few KB left out): the floor of a step measured on
    the very bytes it reads (a screened lm_head's int8 screen, as a greedy step reads it). On
    a VM equal buffers read at rates up to half apart depending on where their pages landed,
    so a fresh buffer's bandwidth says little about the weights'. None where the kernel holds
    no weights (the PyTorch path, a GPU)."""
    lib = load_library()
    weights = []
    for m in model.modules():
        if getattr(m, "kernel_weight", None) is not None:
            s = getattr(m, "screen", None)
            weights += [m.kernel_weight] if s is None else list(s.tensors)
    if lib is None or not weights:
        return None
    times = []
    for _ in range(repeats + 1):                          # the first run warms up
        t = time.perf_counter()
        read_once(lib, weights)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def decode_against_read(llm, tokens: int = 128, repeats: int = 5) -> dict[str, float | None]:
    """decode_ms_per_token's timings, each between two `weights_read_ms` of the target: the
    medians of the decode ms ("decode_ms"), of the reads ("read_ms") and of each timing over
    the mean of its two reads ("over_read"). The machine's bandwidth drifts between timings on
    a shared host; a ratio taken across the same seconds does not drift with it. read_ms and
    over_read are None without the kernel."""
    model = llm.engine.model
    greedy_seconds(llm, 8)
    reads, decodes, ratios = [weights_read_ms(model)], [], []
    for _ in range(repeats):
        decodes.append(_decode_ms(llm, tokens))
        reads.append(weights_read_ms(model))
        if reads[0] is not None:
            ratios.append(decodes[-1] / ((reads[-2] + reads[-1]) / 2))
    return {"decode_ms": statistics.median(decodes),
            "read_ms": statistics.median(reads) if ratios else None,
            "over_read": statistics.median(ratios) if ratios else None}


@torch.inference_mode()
def step_ms(llm, rows: int, context: int = 64, repeats: int = 7, batch: int = 1) -> float:
    """Median time of one target step of `rows` new tokens for each of `batch` requests after
    `context` cached ones, logits included: a decode (1 row) or the verify of rows - 1
    drafts. Eager on a GPU (the engine replays such steps from graphs)."""
    engine = llm.engine
    model, dev = engine.model, engine.device
    ids = torch.arange(10, 10 + rows, device=dev).repeat(batch)
    md, pos = build_metadata([context] * batch, [rows] * batch, list(range(batch)), dev)
    times = []
    for _ in range(repeats + 1):                          # the first run warms up
        _sync(dev)
        t = time.perf_counter()
        model.compute_logits(model(ids, pos, md, engine.cache.layers))
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


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
    the CPU kernel holds them (bfloat16-valued weights packed in bfloat16, int8 with its
    scales; a screened lm_head as its int8 screen, which a greedy step reads instead), else as
    the model's parameters (float32 for a kernel-packed one)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    lm_head_packed = False
    for m in model.modules():
        if getattr(m, "kernel_weight", None) is not None:
            screen = getattr(m, "screen", None)
            total += ((m.kernel_weight if screen is None else screen).nbytes if streamed
                      else m.in_features * m.out_features * 4)
            lm_head_packed |= m is model.lm_head
    if not model.args.tie_word_embeddings or lm_head_packed:
        e = model.embed_tokens.weight
        total -= e.numel() * e.element_size()
    return total


def git_commit() -> str:
    """The checkout's commit (with "+dirty" when it has local changes), or "unknown"."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "specserve"], capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def vector_isa() -> str:
    """The CPU's widest vector instruction set, which the kernel's -march=native build uses:
    "avx512", "avx2", or else the architecture's name."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else platform.machine()


def machine(threads: int | None = None, device: str = "cpu") -> dict:
    """The machine a run was taken on (runs on different machines are not comparable)."""
    out = {"cpu": cpu_name(), "arch": platform.machine(), "isa": vector_isa(),
           "cpus": os.cpu_count(),
           "torch_threads": threads or torch.get_num_threads(), "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "commit": git_commit()}
    if torch.device(device).type == "cuda":
        out |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return out
