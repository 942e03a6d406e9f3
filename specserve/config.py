"""Engine configuration: one dataclass per concern, the single source of defaults.

Every field's default lives here; the CLI reads defaults and help from these dataclasses
(`field_help`), so they never drift apart.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was requested but CUDA is not available; use device='cpu'")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"device {name!r} is not supported; use 'cpu', 'cuda', 'cuda:N' or 'auto'")
    return torch.device(name)


@dataclass
class ModelConfig:
    model: str = field(metadata={"help": "path of a local Hugging Face model directory"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output; default: the model's context"})
    seed: int = field(default=0, metadata={"help": "seed for requests that give none"})

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        resolve_device(self.device)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = field(default=16, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "token budget of one engine step (prompt chunks + decode)"})

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running request can decode each step")


def field_help(cls: type) -> dict[str, tuple[Any, str]]:
    """name -> (default, help) for a config dataclass; used to build CLI flags."""
    out = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        out[f.name] = (default, f.metadata.get("help", ""))
    return out


def load_json_or_yaml_arg(value: str | None) -> dict | None:
    """Parse a CLI value given as inline JSON or as `@path` to a JSON/YAML file."""
    if value is None:
        return None
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    else:
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"could not parse {value!r} as JSON ({e}); pass a JSON object "
                             "or @file.yaml") from e
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON/YAML mapping, got {type(data).__name__}")
    return data
