"""Per-request sampling knobs (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported; only n=1 (send the request n times "
                             "with different seeds instead)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strings = stop
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
