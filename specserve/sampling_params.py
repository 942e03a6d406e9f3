"""Per-request sampling knobs (vLLM names), validated for what the sampler computes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

# Logits are divided by the temperature in float32. Below this a finite logit of a few hundred
# can overflow to inf (inf - inf = NaN in the softmax); 1e-5 leaves a margin of 1e33, and a
# temperature that small samples the argmax anyway.
MIN_TEMPERATURE = 1e-5
# The range torch.Generator.manual_seed accepts (a signed or unsigned 64-bit integer).
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_LOGPROBS = 20


def _finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's shape): exactly one of a JSON schema (`json`, a dict
    or its JSON text), any JSON object (`json_object`), a regular expression (`regex`), one of
    several strings (`choice`) or a Lark grammar (`grammar`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, "
                             f"choice, grammar; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty "
                             "strings")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16       # None = up to the context length
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None       # top logprobs to return per token (0 = only the sampled)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # drafts per step for this request: 0 = no speculation, None = the engine's K (at most it)
    num_speculative_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    presence_penalty: float = 0.0       # [-2, 2]: minus this for every token already output
    frequency_penalty: float = 0.0      # [-2, 2]: minus this times its count in the output
    repetition_penalty: float = 1.0     # > 0: logits of prompt and output tokens divided by it
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit, [-100, 100]
    # log-probabilities of the prompt's tokens (each given the ones before it) and the top N;
    # the prompt is then computed whole, never taken from the prefix cache
    prompt_logprobs: int | None = None

    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p"):
            _finite(name, getattr(self, name))
        if self.temperature != 0 and not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        # top_p is compared in float32: a positive float64 that rounds to 0 would drop every token
        if not (0 < self.top_p <= 1 and torch.tensor(self.top_p, dtype=torch.float32) > 0):
            raise ValueError(f"top_p must be in (0, 1] and not round to 0 in float32 (it "
                             f"must be at least 1e-45), got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError("num_speculative_tokens must be an integer >= 0 (0: no speculation "
                             f"for this request), got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _finite("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got "
                             f"{self.repetition_penalty}")
        for t, b in (self.logit_bias or {}).items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            _finite("a logit_bias value", b)
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for {t}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strings = stop
        self.stop_token_ids = list(self.stop_token_ids or [])

    def samples(self) -> list[SamplingParams]:
        """The n independent requests that make up n outputs: sample i seeded seed + i (when a
        seed is given; else each draws the engine's own)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None
                                    else (self.seed + i) % 2**63) for i in range(self.n)]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
