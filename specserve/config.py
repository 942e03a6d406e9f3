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
import yaml

from specserve.token_tree import TokenTree

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


QUANTIZATIONS = ("int8", "q8_0", "q4_1", "q4_0")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def check_quantization(value: str | None, key: str = "quantization") -> None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"{key}={value!r} is not supported; use one of "
                         f"{', '.join(QUANTIZATIONS)}, or leave it unset for the checkpoint's "
                         "weights as they are")


@dataclass
class ModelConfig:
    model: str = field(metadata={"help": "path of a local Hugging Face model directory"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output; default: the model's context"})
    seed: int = field(default=0, metadata={"help": "seed for requests that give none"})
    cpu_kernel: bool = field(default=True, metadata={
        "help": "float32 or bfloat16 on the CPU: run decode, verify and prompt steps (up to "
                "512 rows with AVX-512, 48 with AVX2) in specserve's compiled kernel (built "
                "with the C compiler on first use; the PyTorch path runs where it cannot be)"})
    quantization: str | None = field(default=None, metadata={
        "help": "int8: quantize the weights at load (symmetric, one scale per output column) "
                "and multiply them in the CPU kernel: a quarter of float32's bytes per step, "
                "half of bfloat16's; q8_0, q4_1, q4_0: llama.cpp's blocks of 32 (the vocabulary "
                "projection in q8_0 with the 4-bit ones, as llama.cpp's files keep it), "
                "multiplied as they are: a GGUF of those types loaded in float32 runs its own "
                "blocks byte for byte"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "the target's KV cache: auto, in the model's dtype (bfloat16 for dtype="
                "bfloat16, also where the CPU kernel computes it in float32: half the memory "
                "and attention reads of float32, keys and values rounded once as they are "
                "written); float32 or bfloat16 whatever the model's dtype"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run every step eagerly instead of replaying CUDA graphs captured for "
                "decode, verify and draft-chain steps (vLLM's flag)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks the target's layers are split over (Megatron-style, one process per "
                "rank, gloo on the CPU), each with its share of the threads"})
    freeze_gc: bool = field(default=False, metadata={
        "help": "move everything alive once the engine is built (models, caches, tokenizer) "
                "out of Python's garbage collector (gc.freeze), so that its collections during "
                "decoding stop walking them (the benchmarks turn it on). It changes the "
                "collector of the whole process, so it is off unless asked"})

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        resolve_device(self.device)
        check_quantization(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one "
                             f"of {', '.join(KV_CACHE_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = field(default=16, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "token budget of one engine step (prompt chunks + decode)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of prompt prefixes seen before (a system prompt, a document, the "
                "chat history), the target's and the drafters', matched by content in blocks "
                "of 16 tokens"})
    prefix_caching_max_tokens: int = field(default=8192, metadata={
        "help": "prefix caching: tokens of KV kept for reuse beside the running requests' (in "
                "each cache: the target's and the drafters'), least recently used evicted first"})

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running request can decode each step")
        if self.prefix_caching_max_tokens < 1:
            raise ValueError("prefix_caching_max_tokens must be >= 1, got "
                             f"{self.prefix_caching_max_tokens} (turn prefix caching off with "
                             "enable_prefix_caching=False)")


def field_help(cls: type) -> dict[str, tuple[Any, str]]:
    """name -> (default, help) for a config dataclass; used to build CLI flags."""
    out = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        out[f.name] = (default, f.metadata.get("help", ""))
    return out


def load_json_or_yaml_arg(value: str | None) -> dict | None:
    """Parse a CLI value given as inline JSON, inline YAML (`"$(cat spec.yaml)"`, as vLLM's
    examples pass it) or `@path` to a JSON/YAML file."""
    if value is None:
        return None
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    else:
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            try:
                data = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ValueError(f"could not parse {value!r} as JSON ({e}) or YAML; pass a "
                                 "JSON object, YAML mapping text or @file.yaml") from e
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON/YAML mapping, got {type(data).__name__}")
    return data


REJECTION_METHODS = ("strict", "probabilistic", "synthetic")
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed")


@dataclass
class SpeculativeConfig:
    """`speculative_config` (vLLM key names). Build from user input with `from_dict`."""

    method: str | None = field(default=None, metadata={
        "help": "the drafting method (specserve.methods.REGISTRY); detected from `model` "
                "when omitted"})
    model: str | None = field(default=None, metadata={"help": "draft model or head directory"})
    num_speculative_tokens: int | None = field(default=None, metadata={
        "help": "K, most draft tokens per request per step"})
    prompt_lookup_min: int | None = field(default=None, metadata={"help": "ngram: shortest match"})
    prompt_lookup_max: int | None = field(default=None, metadata={"help": "ngram: longest match"})
    suffix_decoding_max_tree_depth: int = field(default=24, metadata={
        "help": "suffix: longest pattern matched / tree depth"})
    suffix_decoding_max_cached_requests: int = field(default=10000, metadata={
        "help": "suffix: past responses in the global tree (0 = none)"})
    suffix_decoding_max_spec_factor: float = field(default=1.0, metadata={
        "help": "suffix: draft length <= factor x match length"})
    suffix_decoding_min_token_prob: float = field(default=0.1, metadata={
        "help": "suffix: stop drafting below this running probability"})
    draft_tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks of the drafter: 1 (it runs on rank 0 beside the sharded target, vLLM's "
                "advice) or the target's tensor_parallel_size (a draft model, or an eagle, "
                "eagle3 or mtp head's decoder layers, sharded like the target)"})
    quantization: str | None = field(default=None, metadata={
        "help": "int8, q8_0, q4_1, q4_0: the drafter's weights quantized at load, as the "
                "target's `quantization` "
                "(default: unquantized, whatever the target's)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "the drafter's context: past it a request decodes on without drafts; at most "
                "the target's and the drafter's own (default: the drafter's)"})
    rejection_sample_method: str = field(default="strict", metadata={
        "help": "strict (lossless, alias standard), probabilistic, synthetic (benchmarking)"})
    synthetic_acceptance_rate: float | None = field(default=None, metadata={
        "help": "synthetic only: probability that each draft token is accepted once the ones "
                "before it were"})
    synthetic_acceptance_rates: list | None = field(default=None, metadata={
        "help": "synthetic only: K non-increasing probabilities that draft 1..K is accepted "
                "(unconditional, as vLLM's)"})
    synthetic_acceptance_length: float | None = field(default=None, metadata={
        "help": "synthetic only: a mean acceptance length in [1, K+1], turned into rates "
                "[1, ..., 1, fraction, 0, ...]"})
    draft_sample_method: str = field(default="greedy", metadata={
        "help": "greedy or probabilistic drafting (draft_model)"})
    disable_by_batch_size: int | None = field(default=None, metadata={
        "help": "no speculation while this many requests or more are running"})
    num_speculative_tokens_per_batch_size: list | None = field(default=None, metadata={
        "help": "[[start, end, K], ...]: K by number of running requests (inclusive ranges)"})
    draft_confidence_threshold: float = field(default=0.0, metadata={
        "help": "draft_model, eagle, eagle3, mtp: stop a request's drafts at the first token "
                "the drafter gives less than this probability (0 = always K)"})
    speculative_token_tree: str | list | None = field(default=None, metadata={
        "help": "eagle, eagle3, medusa, mtp: verify a tree of candidates, a list of paths of child "
                "ranks such as \"[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]\"; K = the number of nodes"})
    hybrid_prompt_lookup: int | None = field(default=None, metadata={
        "help": "draft_model and head methods: N turns on prompt lookup first: a request whose "
                "last N or more tokens occurred earlier in its prompt or output drafts the "
                "tokens that followed the longest such match, with no drafter pass; the "
                "drafter drafts the others (None = off)"})
    hidden_states_dir: str | None = field(default=None, metadata={
        "help": "extract_hidden_states: the directory each finished request's hidden states "
                "are written to (one safetensors file per request)"})
    hidden_states_layers: list | None = field(default=None, metadata={
        "help": "extract_hidden_states: target layers whose inputs are kept (default: the "
                "EAGLE-3 layers 2, L/2, L-3)"})
    hidden_states_max_bytes: int = field(default=1 << 30, metadata={
        "help": "extract_hidden_states: stop writing once the directory's files reach this "
                "size"})
    parallel_drafting: bool = field(default=False, metadata={
        "help": "draft all K tokens in one pass of a drafter trained for it: draft_model (PARD, "
                "`specserve train pard`), eagle3 (P-EAGLE, `specserve train eagle3 --parallel`); "
                "dflash always does"})
    adaptive_k: bool = field(default=False, metadata={
        "help": "choose K per step (0..num_speculative_tokens) for the most tokens/s, from "
                "measured acceptance and step times at the current batch size"})
    # method "auto": what it chose and why (set by methods.resolve, shown in the backend line)
    auto_choice: str | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        if isinstance(data, SpeculativeConfig):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(data).__name__}")
        valid = [f.name for f in dataclasses.fields(cls) if f.init]
        for key in data:
            if key in _SAMPLING_KEYS:
                raise ValueError(f"speculative_config key {key!r} is a sampling parameter; set "
                                 "it in SamplingParams (or the request), not in speculative_config")
            if key == "tensor_parallel_size":
                raise ValueError("speculative_config key 'tensor_parallel_size' is not valid; "
                                 "use 'draft_tensor_parallel_size'")
            if key not in valid:
                raise ValueError(f"unknown speculative_config key {key!r}; valid keys: "
                                 f"{', '.join(valid)}")
        return cls(**data)

    def __post_init__(self) -> None:
        # What depends on the method (its detection, its own keys, what it can do) is checked
        # by the method registry: specserve.methods.resolve.
        if self.speculative_token_tree is not None:
            self._check_tree()
        # None: the method's checkpoint may give it (methods.resolve), else it is required
        if self.num_speculative_tokens is not None:
            self.check_k()
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1, got "
                             f"{self.suffix_decoding_max_tree_depth}")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0 (0 = no global "
                             f"tree), got {self.suffix_decoding_max_cached_requests}")
        if self.suffix_decoding_max_spec_factor < 0:
            raise ValueError("suffix_decoding_max_spec_factor must be >= 0, got "
                             f"{self.suffix_decoding_max_spec_factor}")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob}")
        check_quantization(self.quantization, "speculative_config quantization")
        if self.draft_tensor_parallel_size < 1:
            raise ValueError("draft_tensor_parallel_size must be >= 1, got "
                             f"{self.draft_tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"speculative max_model_len must be >= 2, got {self.max_model_len}")
        if self.rejection_sample_method == "standard":
            self.rejection_sample_method = "strict"
        if self.rejection_sample_method not in REJECTION_METHODS:
            raise ValueError(f"rejection_sample_method {self.rejection_sample_method!r} is not "
                             f"known; use one of {', '.join(REJECTION_METHODS)} (or 'standard')")
        given = [k for k in ("synthetic_acceptance_rate", "synthetic_acceptance_rates",
                             "synthetic_acceptance_length") if getattr(self, k) is not None]
        if self.rejection_sample_method == "synthetic":
            if len(given) != 1:
                raise ValueError("rejection_sample_method 'synthetic' needs one of "
                                 "synthetic_acceptance_rate, synthetic_acceptance_rates or "
                                 f"synthetic_acceptance_length, got {given or 'none'}")
            rate = self.synthetic_acceptance_rate
            if rate is not None and not (isinstance(rate, (int, float)) and 0 <= rate <= 1):
                raise ValueError("rejection_sample_method 'synthetic' needs "
                                 f"synthetic_acceptance_rate in [0, 1], got {rate}")
        elif given:
            raise ValueError(f"{given[0]} is only used with rejection_sample_method "
                             "'synthetic'")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method must be 'greedy' or 'probabilistic', got "
                             f"{self.draft_sample_method!r}")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 2):
            raise ValueError("disable_by_batch_size must be an int >= 2, got "
                             f"{self.disable_by_batch_size!r}")
        if self.num_speculative_tokens_per_batch_size is not None:
            _check_schedule(self.num_speculative_tokens_per_batch_size)
        t = self.draft_confidence_threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < 1:
            raise ValueError(f"draft_confidence_threshold must be a number in [0, 1), got {t!r}")
        n = self.hybrid_prompt_lookup
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"hybrid_prompt_lookup must be an int >= 1 (the tokens to match) "
                             f"or null, got {n!r}")
        if not isinstance(self.adaptive_k, bool):
            raise ValueError(f"adaptive_k must be true or false, got {self.adaptive_k!r}")

    def check_k(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be an int > 0, got "
                             f"{self.num_speculative_tokens!r}")
        if self.num_speculative_tokens > 128:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} is above "
                             "the limit of 128")

    def synthetic_rates(self) -> list[float] | None:
        """The conditional probability that draft i is accepted once drafts 1..i-1 were, for
        i = 1..K (synthetic verification); None when not synthetic. K must be known."""
        if self.rejection_sample_method != "synthetic":
            return None
        k = self.num_speculative_tokens
        if self.synthetic_acceptance_rate is not None:
            return [float(self.synthetic_acceptance_rate)] * k
        rates = self.synthetic_acceptance_rates
        if rates is None:                    # the minimum-variance schedule of a mean length
            length = self.synthetic_acceptance_length
            if not (isinstance(length, (int, float)) and 1 <= length <= k + 1):
                raise ValueError(f"synthetic_acceptance_length must be in [1, K+1] = [1, "
                                 f"{k + 1}], got {length!r}")
            whole = int(length - 1)
            rates = [1.0] * whole + ([length - 1 - whole] if whole < k else [])
            rates += [0.0] * (k - len(rates))
        if (not isinstance(rates, list) or len(rates) != k
                or not all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in rates)
                or any(b > a for a, b in zip(rates, rates[1:]))):
            raise ValueError(f"synthetic_acceptance_rates must be a list of K = {k} "
                             f"non-increasing numbers in [0, 1], got {rates!r}")
        # unconditional p_i -> conditional c_i = p_i / p_(i-1) (1 where p_(i-1) = 0: never
        # reached)
        return [float(p) / prev if prev > 0 else 1.0
                for p, prev in zip(rates, [1.0, *rates[:-1]])]

    def _check_tree(self) -> None:
        tree = TokenTree.parse(self.speculative_token_tree)
        self.speculative_token_tree = [list(p) for p in tree.paths]     # normalised, JSON-able
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = len(tree)
        elif self.num_speculative_tokens != len(tree):
            raise ValueError(f"num_speculative_tokens ({self.num_speculative_tokens}) must equal "
                             f"the number of nodes of speculative_token_tree ({len(tree)}); "
                             "leave it out to take the tree's size")
        if self.rejection_sample_method == "synthetic":
            raise ValueError("speculative_token_tree cannot be used with rejection_sample_method "
                             "'synthetic' (it fakes acceptance along a chain)")
        if self.draft_confidence_threshold:
            raise ValueError("speculative_token_tree and draft_confidence_threshold cannot be "
                             "combined: the tree fixes which candidates are drafted")

    def token_tree(self) -> TokenTree | None:
        """The draft tree, None for a chain (the default)."""
        if self.speculative_token_tree is None:
            return None
        tree = TokenTree.parse(self.speculative_token_tree)
        return None if tree.is_chain else tree

    def k_for_batch_size(self, batch_size: int) -> int:
        """Draft tokens per request when `batch_size` requests are running."""
        k = self.num_speculative_tokens
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return 0
        if self.num_speculative_tokens_per_batch_size:
            # Gaps and the tail carry the previous range's K forward.
            for start, _end, k_range in self.num_speculative_tokens_per_batch_size:
                if batch_size >= start:
                    k = min(k_range, self.num_speculative_tokens)
        return k


def _check_schedule(schedule) -> None:
    hint = ("num_speculative_tokens_per_batch_size must be a list of [start, end, K] with "
            "inclusive ranges, the first starting at 1, sorted and not overlapping, K >= 0")
    if not isinstance(schedule, list) or not schedule:
        raise ValueError(hint)
    prev_end = 0
    for i, entry in enumerate(schedule):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(
                isinstance(x, int) for x in entry):
            raise ValueError(f"{hint}; entry {i} is {entry!r}")
        start, end, k = entry
        if (i == 0 and start != 1) or start <= prev_end or end < start or k < 0:
            raise ValueError(f"{hint}; entry {i} is {list(entry)!r}")
        prev_end = end


@dataclass
class EngineConfig:
    model_config: ModelConfig
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
    log_stats_interval_s: float = 0.0       # > 0: log spec metrics every so many seconds


@dataclass
class ServerConfig:
    """`specserve serve`: where it listens and what a request may be."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "port to bind"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name in the API (default: the model path)"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on every route but /health"})
    public_metrics: bool = field(default=False, metadata={
        "help": "with --api-key: leave /metrics and the API docs open"})
    allowed_hosts: str | None = field(default=None, metadata={
        "help": "comma-separated Host header names the server answers (stops DNS rebinding); "
                "'*' for any (default: the bound host and localhost; any when bound to all "
                "interfaces)"})
    allowed_origins: str | None = field(default=None, metadata={
        "help": "comma-separated origins that browsers may call from (CORS); default: none"})
    max_request_bytes: int = field(default=1 << 20, metadata={
        "help": "largest request body, enforced while reading"})
    request_body_timeout_s: float = field(default=30.0, metadata={
        "help": "seconds a client has to send its whole request body"})
    max_prompts_per_request: int = field(default=64, metadata={
        "help": "most prompts one completions request may carry"})
    max_prompt_tokens_per_request: int | None = field(default=None, metadata={
        "help": "most prompt tokens over all prompts of one request (default: 8 x the "
                "context length)"})
    default_max_tokens: int | None = field(default=None, metadata={
        "help": "max_tokens of a prompt whose request gives none (default: the rest of the "
                "context)"})
    max_tokens_per_request: int | None = field(default=None, metadata={
        "help": "most tokens to generate over all prompts of one request, max_tokens x "
                "prompts (default: 8 x the context length)"})
    max_stop: int = field(default=16, metadata={
        "help": "most stop strings, and most stop_token_ids, one request may give"})
    max_stop_chars: int = field(default=256, metadata={
        "help": "longest stop string, in characters"})

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompts_per_request", "max_stop",
                     "max_stop_chars", "max_prompt_tokens_per_request", "default_max_tokens",
                     "max_tokens_per_request"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.request_body_timeout_s > 0:
            raise ValueError(f"request_body_timeout_s must be > 0, got "
                             f"{self.request_body_timeout_s}")

    def host_names(self) -> frozenset[str] | None:
        """Host header names to answer; None = any."""
        if self.allowed_hosts is not None:
            names = {h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()}
            return None if "*" in names else frozenset(names)
        if self.host in ("0.0.0.0", "::", ""):
            return None
        return frozenset({self.host.lower(), "localhost", "127.0.0.1", "::1"})

    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]
