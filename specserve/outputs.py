"""What `LLM.generate` returns (vLLM shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.metrics import SpecDecodingStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error" (RequestOutput.error says why) or None while running
    finish_reason: str | None
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
    spec_metrics: SpecDecodingStats | None = None     # this request's speculation summary
    metrics: dict[str, float] = field(default_factory=dict)   # arrival/first token/finish times
    error: str | None = None      # set when the engine aborted this request alone (its fault)
    num_cached_tokens: int = 0    # prompt tokens whose KV came from the prefix cache
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token: logprob}
    prompt_logprobs: list[dict[int, float] | None] | None = None
