"""`LLM`: the offline facade over LLMEngine (vLLM's shape)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from specserve.config import EngineConfig, ModelConfig, SchedulerConfig
from specserve.engine.engine import LLMEngine
from specserve.inputs import PromptType
from specserve.methods import resolve_speculative_config
from specserve.metrics import Metric
from specserve.models.catalogue import resolve_model
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def build_engine_config(model: str, speculative_config: dict | None = None,
                        **kwargs) -> EngineConfig:
    """Split keyword arguments over the config dataclasses; unknown names are an error."""
    known = _fields(ModelConfig) | _fields(SchedulerConfig) | {"log_stats_interval_s"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(known)}")
    model = resolve_model(model)        # a catalogue name (pulled), a Hub id: a local path
    mc = ModelConfig(model=model, **{k: v for k, v in kwargs.items() if k in _fields(ModelConfig)})
    sc = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in _fields(SchedulerConfig)})
    spec = (resolve_speculative_config(speculative_config, model)
            if speculative_config is not None else None)
    return EngineConfig(mc, sc, spec, kwargs.get("log_stats_interval_s", 0.0))


def merge_samples(outs: list[RequestOutput]) -> RequestOutput:
    """The outputs of a prompt's n samples as one RequestOutput with n completions."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    comps = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    return dataclasses.replace(first, outputs=comps,
                               error="; ".join(o.error for o in outs if o.error) or None)


class LLM:
    """Generate text offline.

    >>> llm = LLM(model="models/code-target", dtype="float32", device="cpu", seed=0)
    >>> llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=32))
    """

    def __init__(self, model: str, speculative_config: dict | None = None, **kwargs) -> None:
        self.engine = LLMEngine(build_engine_config(model, speculative_config, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        ids: list[list[str]] = []          # per prompt, the request of each of its n samples
        for p, sp in zip(prompts, params):
            if isinstance(p, dict):
                if "prompt_token_ids" not in p:
                    raise ValueError("a dict prompt must be TokensPrompt(prompt_token_ids=[...])")
                p = list(p["prompt_token_ids"])
            elif not isinstance(p, str):
                raise TypeError(f"prompt of type {type(p).__name__} is not supported; give a "
                                "string or TokensPrompt")
            ids.append([self.engine.add_request(p, s) for s in sp.samples()])
        done: dict[str, RequestOutput] = {}
        total = sum(map(len, ids))
        bar = tqdm(total=total, desc="generate", disable=not use_tqdm or total < 2)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [merge_samples([done[i] for i in group]) for group in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to
        several, each rendered with the model's chat template first (as vLLM's LLM.chat)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.chat_prompt(list(c), add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> list[Metric]:
        """The speculation metrics as vLLM's LLM.get_metrics() gives them: counters and vectors
        named "vllm:spec_decode_*" with `value` / `values`."""
        return self.engine.spec_stats.as_metrics()

    def get_stats(self) -> dict:
        """The same counters as a dict, with the derived rates (mean acceptance length,
        acceptance rate) and the proposer's own counters."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (vLLM's `LLM.reset_prefix_cache`)."""
        self.engine.reset_prefix_cache()
