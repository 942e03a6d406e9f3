"""The files `extract_hidden_states` writes (`specserve train chat-data`: a target's answers with
its hidden states), read as training data: every drafter of a target that training cannot run
cheaply learns from them (the heads from the states, a draft model from the tokens and the
target's distribution over its last hidden state).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specserve.train.trainer import TrainConfig


def read_hidden_states(directories: Path | Sequence[Path], dtype: torch.dtype | None = None
                       ) -> tuple[list[dict[str, torch.Tensor]], tuple[int, ...]]:
    """The files `extract_hidden_states` wrote to `directories` (one or several: several
    chat-data runs train together), and the target layers they hold. With `dtype` the states are
    held in it (bfloat16 halves the memory of a large set; a bfloat16-autocast run rounds them
    so anyway)."""
    dirs = [Path(directories)] if isinstance(directories, (str, Path)) else list(directories)
    data, layers = [], set()
    for directory in dirs:
        files = sorted(directory.rglob("*.safetensors"))      # batch directories too
        if not files:
            raise ValueError(f"{directory} holds no .safetensors files; write some with "
                             "speculative_config {\"method\": \"extract_hidden_states\", "
                             "\"hidden_states_dir\": ...}")
        for f in files:
            with safe_open(str(f), "pt") as h:
                layers.add(h.metadata()["layers"])
            d = load_file(str(f))
            if dtype is not None:
                d = {k: v.to(dtype) if v.is_floating_point() else v for k, v in d.items()}
            data.append(d)
    if len(layers) != 1:
        raise ValueError(f"{', '.join(map(str, dirs))}: files of different target layers "
                         f"{sorted(layers)}")
    return data, tuple(json.loads(layers.pop()))


def state_batches(data: list[dict[str, torch.Tensor]], cfg: TrainConfig, device: torch.device):
    """batches(step) for `train`: random windows of seq_len + 1 tokens of the files with their
    states (a function of (seed, step) only, so resume is exact)."""
    long = [d for d in data if len(d["token_ids"]) > cfg.seq_len]
    if not long:
        raise ValueError(f"no hidden-state file holds more than --seq-len {cfg.seq_len} tokens; "
                         "lower --seq-len")

    def batch(step: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([cfg.seed, step])
        picks = [(long[i], int(rng.integers(0, len(long[i]["token_ids"]) - cfg.seq_len)))
                 for i in rng.integers(0, len(long), size=cfg.batch_size)]
        S = cfg.seq_len
        return {"xy": torch.stack([d["token_ids"][s:s + S + 1] for d, s in picks]).to(device),
                "positions": torch.stack([torch.arange(s, s + S) for _, s in picks]).to(device),
                "aux_hidden": torch.stack([d["aux_hidden"][s:s + S] for d, s in picks]).to(
                    device, torch.float32),
                "hidden": torch.stack([d["hidden"][s:s + S] for d, s in picks]).to(
                    device, torch.float32)}
    return batch
