"""One training loop for language models: pretraining (cross-entropy on corpus tokens) and
draft distillation (KL to a frozen target's distribution on the same tokens).

AdamW, linear warmup then cosine decay, gradient clipping, optional bf16 autocast, seeded
batches that do not depend on where a run was resumed, checkpoints in safetensors (no pickle),
a JSONL loss log and a PNG loss curve.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specserve.kernels.cpu import cpu_flags


@dataclass
class TrainConfig:
    work_dir: str = field(metadata={"help": "checkpoints, token cache, loss log and plot"})
    steps: int = field(default=2000, metadata={"help": "optimizer steps in the schedule"})
    batch_size: int = field(default=8, metadata={"help": "sequences per step"})
    seq_len: int = field(default=512, metadata={"help": "tokens per training sequence"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr as a share of peak"})
    warmup: int = field(default=100, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm"})
    bf16: bool | None = field(default=None, metadata={
        "help": "bfloat16 autocast; default: where the device multiplies bfloat16 natively (a "
                "GPU that supports it, a CPU with AVX512-BF16 or AMX); elsewhere it only "
                "converts, and a step runs several times slower"})
    seed: int = field(default=0, metadata={"help": "seed for init and batches"})
    eval_every: int = field(default=250, metadata={"help": "steps between validations"})
    ckpt_every: int = field(default=50, metadata={"help": "steps between checkpoints"})
    max_minutes: float | None = field(
        default=None, metadata={"help": "stop (checkpointed, resumable) after this wall time"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads"})
    kd_alpha: float = field(default=1.0, metadata={"help": "distillation: weight of KL vs CE"})
    top1_weight: float = field(default=0.0, metadata={
        "help": "heads and PARD: weight of a cross-entropy to the target's most likely token, "
                "added to the KL (raises greedy acceptance; the logged kl values include it)"})

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "ckpt_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.kd_alpha <= 1:
            raise ValueError(f"kd_alpha must be in [0, 1], got {self.kd_alpha}")
        if self.top1_weight < 0:
            raise ValueError(f"top1_weight must be >= 0, got {self.top1_weight}")


def bf16_autocast(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether `cfg` trains under bfloat16 autocast on `device` (`cfg.bf16` where it is set)."""
    if cfg.bf16 is not None:
        return cfg.bf16
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def batch_at(tokens: np.ndarray, step: int, cfg: TrainConfig) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens; a function of (seed, step) only, so resume is exact."""
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, size=cfg.batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate_bpb(model, tokens: np.ndarray, n_bytes: int, seq_len: int, device: torch.device,
                 bf16: bool, batch: int = 8) -> float:
    """Bits per byte over non-overlapping windows of the whole validation token stream."""
    n = (len(tokens) - 1) // seq_len
    total_nats = 0.0
    counted = 0
    for i in range(0, n, batch):
        rows = [tokens[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(n, i + batch))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model.compute_logits(model(x[:, :-1], _positions(x[:, :-1])))
        total_nats += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(),
                                      reduction="sum").item()
        counted += x[:, 1:].numel()
    # Scale to the whole stream: the tail shorter than one window is left out.
    frac = counted / max(1, len(tokens) - 1)
    return total_nats / (n_bytes * frac) / math.log(2)


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).expand_as(x)


def _save_ckpt(path: Path, model, opt: torch.optim.Optimizer, step: int, log: list) -> None:
    # Trainable parameters (tied ones once) and buffers; frozen modules a head shares with its
    # target are not part of the run.
    keep = {n for n, p in model.named_parameters() if p.requires_grad}
    keep |= {n for n, _ in model.named_buffers()}
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()
               if k in keep}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"opt.{key}.{names[id(p)]}"] = st[key].cpu().contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps({"step": step, "log": log}))


def _load_ckpt(path: Path, model, opt: torch.optim.Optimizer) -> tuple[int, list]:
    tensors = load_file(str(path))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")},
                          strict=False)
    meta = json.loads(path.with_suffix(".json").read_text())
    # the fused (CUDA) AdamW keeps its step counts beside the parameters, the others on the CPU
    on_device = opt.defaults.get("fused") or opt.defaults.get("capturable")
    for name, p in model.named_parameters():
        if f"opt.exp_avg.{name}" in tensors:
            opt.state[p] = {
                "step": torch.tensor(float(meta["step"]), device=p.device if on_device else None),
                "exp_avg": tensors[f"opt.exp_avg.{name}"].to(p.device),
                "exp_avg_sq": tensors[f"opt.exp_avg_sq.{name}"].to(p.device)}
    return meta["step"], meta["log"]


def plot_losses(log: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in log if "loss" in r], [r["loss"] for r in log if "loss" in r],
            label="train loss (nats/token)", alpha=0.6)
    vals = [r for r in log if "val_bpb" in r]
    if vals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in vals], [r["val_bpb"] for r in vals], "o-", color="C1",
                 label="val bits/byte")
        ax2.set_ylabel("val bits/byte")
        ax2.legend(loc="upper center")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def target_logits(teacher, batch) -> torch.Tensor:
    """The teacher's logits [B, S, V] for a batch: a pass over its tokens [B, S + 1], or, for a
    batch of extracted states (`state_batches`), its lm_head over the last hidden states the
    files hold (the same logits without the pass)."""
    if isinstance(batch, dict):
        return teacher.compute_logits(batch["hidden"]).float()
    x = batch[:, :-1]
    return teacher.compute_logits(teacher(x, _positions(x))).float()


def batch_tokens(batch) -> torch.Tensor:
    """The tokens [B, S + 1] of a batch of tokens or of extracted states."""
    return batch["xy"] if isinstance(batch, dict) else batch


def lm_loss(model, teacher=None, kd_alpha: float = 1.0) -> LossFn:
    """Next-token cross-entropy; with a teacher, kd_alpha * KL(teacher || model) + rest * CE.
    The returned function maps a batch (`batch_tokens`) to (loss, values to log)."""
    def fn(batch):
        xy = batch_tokens(batch)
        x, y = xy[:, :-1], xy[:, 1:]
        logits = model.compute_logits(model(x, _positions(x))).float()      # [B, S, V]
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if teacher is None:
            return ce, {"loss": ce.item()}
        with torch.no_grad():
            t_logits = target_logits(teacher, batch)
        kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1),
                      F.log_softmax(t_logits, -1).flatten(0, 1),
                      log_target=True, reduction="batchmean")
        return kd_alpha * kl + (1 - kd_alpha) * ce, {"loss": ce.item(), "kl": kl.item()}
    return fn


def train(model, train_tokens: np.ndarray | None, cfg: TrainConfig, device: torch.device,
          loss_fn: LossFn, evaluate: Callable[[], dict[str, float]] | None = None,
          batches: Callable[[int], object] | None = None) -> list[dict]:
    """Train the trainable parameters of `model` in place on batches of `train_tokens`.

    `loss_fn` turns a batch [B, S + 1] into (loss, values to log); `batches(step)`, when given,
    makes each step's batch instead (any object `loss_fn` takes; a function of the step only,
    so that a resumed run sees the same batches); `evaluate` runs every
    `eval_every` steps and at the end. Checkpoints go to `<work_dir>/checkpoint.safetensors` and
    a run resumes from there. Returns the log (one dict per step). Stops early, resumable,
    after `cfg.max_minutes`.
    """
    out = Path(cfg.work_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    ckpt = out / "checkpoint.safetensors"
    step, log = (_load_ckpt(ckpt, model, opt) if ckpt.is_file() else (0, []))
    if step:
        print(f"resumed from {ckpt} at step {step}", flush=True)
    bf16 = bf16_autocast(cfg, device)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg) | {"bf16": bf16}, indent=2))
    t0 = time.time()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, mininterval=5,
               desc="train " + out.name)
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=bf16)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        batch = (batches(step) if batches is not None
                 else batch_at(train_tokens, step, cfg).to(device))
        with torch.autocast(**amp):
            loss, values = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        rec = {"step": step + 1} | {k: round(v, 4) for k, v in values.items()} | {
            "lr": round(lr_at(step, cfg), 6), "gnorm": round(gnorm.item(), 3),
            "time": round(time.time() - t0, 1)}
        if evaluate is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            model.eval()
            rec |= {k: round(v, 4) for k, v in evaluate().items()}
            model.train()
        log.append(rec)
        bar.set_postfix({k: v for k, v in rec.items() if k not in ("step", "lr", "time")})
        with open(out / "train_log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        timed_out = cfg.max_minutes is not None and time.time() - t0 > cfg.max_minutes * 60
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps or timed_out:
            _save_ckpt(ckpt, model, opt, step + 1, log)
        if timed_out:
            print(f"stopping after {cfg.max_minutes} minutes at step {step + 1}; run the same "
                  "command again to resume", flush=True)
            break
    plot_losses(log, out / "loss.png", f"{out.name}: training")
    return log
