"""What `LLM.generate` returns (vLLM shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeRequestMetrics:
    """Per-request speculation summary."""

    num_drafts: int = 0                 # verify steps that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop", "length" or None while running
    stop_reason: int | str | None = None
    # one dict per token: {token_id: logprob} with the sampled token and the top-N
    logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_metrics: SpecDecodeRequestMetrics | None = None
    metrics: dict[str, float] = field(default_factory=dict)   # arrival/first token/finish times
