"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.metrics import SpecDecodingStats
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator          # per-request randomness: batch-independent sampling
    max_total_tokens: int               # prompt + output never exceed this (max_model_len)
    eos_token_ids: frozenset[int] = frozenset()
    detokenizer: IncrementalDetokenizer | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0        # tokens whose KV is in the cache; rollback = decrease
    spec_token_ids: list[int] = field(default_factory=list)   # drafts to verify next step
    spec_token_probs: torch.Tensor | None = None               # [k, vocab] draft probs or None
    spec_parents: list[int] | None = None                      # draft tree (Proposal.parents)
    spec_budget: int = 0                                       # K the drafts were allowed
    slot: int | None = None             # KV-cache slot while running
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None            # why the engine aborted it (finish_reason "error")
    logprobs: list[dict[int, float]] | None = None
    spec_metrics: SpecDecodingStats = field(default_factory=lambda: SpecDecodingStats(0))
    first_token_time: float | None = None
    num_cached_tokens: int = 0          # prompt tokens whose KV came from the prefix cache
    prompt_stored: bool = False         # its prompt's blocks are in the prefix cache
    grammar: Any = None                 # structured output: its llguidance matcher
    # SamplingParams.prompt_logprobs: None for the first token, then one dict per prompt token
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def max_new_tokens(self) -> int:
        """Output tokens still allowed by max_tokens and the context length."""
        cap = self.max_total_tokens - self.num_tokens
        if self.params.max_tokens is not None:
            cap = min(cap, self.params.max_tokens - len(self.output_token_ids))
        return cap
