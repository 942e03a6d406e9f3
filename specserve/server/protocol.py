"""OpenAI request and response schemas (pydantic). Unknown fields are rejected by name."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.sampling_params import (
    MAX_LOGPROBS,
    MIN_TEMPERATURE,
    SEED_RANGE,
    SamplingParams,
    StructuredOutputsParams,
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema: "
                             "{\"name\": ..., \"schema\": {...}}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI + vLLM extras)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # the limits SamplingParams enforces, stated here so that the OpenAPI document carries them
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0, description=(
        "at least 1 (0 only with echo: the prompt's log-probabilities alone); at most the "
        "server's --max-tokens-per-request; default the server's --default-max-tokens"))
    temperature: float = Field(default=1.0, ge=0, description=(
        f"0 = greedy, else at least {MIN_TEMPERATURE}"), json_schema_extra={
        "anyOf": [{"const": 0}, {"minimum": MIN_TEMPERATURE}]})
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, description=(
        "non-empty strings, at most the server's --max-stop of them, each at most "
        "--max-stop-chars characters"))
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, description="1 = off")
    logit_bias: dict[str, float] | None = Field(default=None, description=(
        "token id (as a string) -> bias in [-100, 100]"))
    user: str | None = None
    # vLLM-style extras
    top_k: int = Field(default=-1, ge=-1, description="-1 = off, else at least 1")
    min_p: float = Field(default=0.0, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, description=(
        "token ids inside the vocabulary, at most the server's --max-stop of them"))
    include_stop_str_in_output: bool = False
    include_spec_metrics: bool = Field(
        default=False, description="add the request's speculative-decoding summary")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None           # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    num_speculative_tokens: int | None = Field(
        default=None, ge=0, description="drafts per step for this request: 0 = no speculation; "
        "at most the server's num_speculative_tokens (default: that)")
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description=(
            "vLLM's: each prompt token's log-probability given the tokens before it, with the "
            "top N, in each choice's prompt_logprobs (not with stream)"))

    @model_validator(mode="after")
    def _checks(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs come with non-streamed answers; drop stream or "
                             "prompt_logprobs")
        if self.max_tokens == 0 and getattr(self, "echo", False):
            return self                  # the prompt's log-probabilities only (echo)
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint from whichever field gave it (ValueError when
        several did)."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given.append(StructuredOutputsParams(json_object=True) if rf.type == "json_object"
                         else StructuredOutputsParams(json=rf.json_schema.schema_))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                                 grammar=so.grammar,
                                                 json_object=so.json_object))
        for key in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{key}")
            if value is not None:
                given.append(StructuredOutputsParams(**{key: value}))
        if len(given) > 1:
            raise ValueError("give one of response_format, structured_outputs and guided_*")
        return given[0] if given else None

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids written as strings, as OpenAI's) read as ints."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not k.isdigit()]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids written as strings, got {bad[:3]}")
        return {int(k): v for k, v in self.logit_bias.items()}

    def samples_per_prompt(self) -> int:
        return self.n

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.samples_per_prompt(), temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, max_tokens=max_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            num_speculative_tokens=self.num_speculative_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.token_bias(),
            prompt_logprobs=self.prompt_logprobs, structured_outputs=self.structured())


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, description=(
        "samples drawn per prompt, of which the n with the highest sum of log-probabilities "
        "are returned; at least n, not with stream"))
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
            if self.stream and self.best_of > self.n:
                raise ValueError("best_of > n cannot stream (the best are known only at the "
                                 "end); drop stream or best_of")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def samples_per_prompt(self) -> int:
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _max_completion(self):
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens <= 0:
                raise ValueError("max_completion_tokens must be at least 1")
            self.max_tokens = self.max_completion_tokens
        return self


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", code: int | str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body every 4xx and 5xx answer carries."""

    error: ErrorInfo


# ---- success bodies (documented in the OpenAPI document; the routes build them as dicts) -----
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Body):
    cached_tokens: int = Field(ge=0, description="prompt tokens whose KV the prefix cache held")


class Usage(_Body):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


class SpecMetrics(_Body):
    """One request's speculative-decoding summary (include_spec_metrics)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float
    mean_acceptance_length: float


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(
        description="None for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Body):
    logprob: float
    decoded_token: str


# prompt_logprobs of a choice: None for the first token, then token id -> its entry
PromptLogprobs = list[dict[str, PromptLogprob] | None] | None
FinishReason = Literal["stop", "length", "abort", "error"] | None


class _Answer(_Body):
    """What every answer and stream chunk of the generation routes carries."""

    id: str
    created: int
    model: str


class CompletionStreamChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionChoice(CompletionStreamChoice):
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs = None


class CompletionResponse(_Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage
    spec_metrics: list[SpecMetrics | None] | None = None


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob]


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs = None


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage
    spec_metrics: list[SpecMetrics | None] | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Body):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Body):
    prompt: str


class VersionResponse(_Body):
    version: str


class CompletionChunk(_Answer):
    """One event of a streamed completion (choices empty in the final usage chunk)."""

    object: Literal["text_completion"]
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None
    spec_metrics: SpecMetrics | None = None


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(_Answer):
    """One event of a streamed chat completion: each choice's role first, then its text."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    spec_metrics: SpecMetrics | None = None
