"""What a benchmark runs: specserve's LLM or transformers' generate() on a prompt group, each
with the same interface, and the result a suite collects for each."""

from __future__ import annotations

import gc
import statistics
from dataclasses import asdict, dataclass, field

import torch

from specserve.bench.probes import resident_bytes
from specserve.config import QUANTIZATIONS
from specserve.llm import LLM
from specserve.models.backend import release_freed_memory
from specserve.sampling_params import SamplingParams


@dataclass
class Result:
    name: str
    tokens_per_s: list[float] = field(default_factory=list)
    # per round, the median over requests of (finish - first token) / (tokens - 1): decode
    # alone, as vLLM's TPOT (tokens/s above include each prompt's prefill)
    tpot_ms: list[float] = field(default_factory=list)
    tau: float | None = None
    acceptance_rate: float | None = None
    per_pos: list[float] | None = None
    same_output: str | None = None      # prompts whose greedy tokens equal no-spec's, "7/8"
    draft_ms: float | None = None       # the proposer's time per drafting step
    note: str | None = None             # what the runner reports beside its name (`note()`)
    resident_mb: float | None = None    # resident memory its engine added when it loaded

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def tpot(self) -> float | None:
        return statistics.median(self.tpot_ms) if self.tpot_ms else None

    def as_dict(self) -> dict:
        return asdict(self) | {"median_tokens_per_s": self.median, "median_tpot_ms": self.tpot}


def precision_args(dtype: str) -> dict:
    """The LLM arguments of a bench precision: a dtype, or "int8" (the checkpoint's bfloat16
    weights quantized at load), or a llama.cpp block type (loaded in float32, so that a GGUF
    of that type keeps its own blocks)."""
    if dtype == "int8":
        return {"dtype": "bfloat16", "quantization": "int8"}
    if dtype in QUANTIZATIONS:
        return {"dtype": "float32", "quantization": dtype}
    return {"dtype": dtype}


class SpecserveRunner:
    def __init__(self, name: str, target: str, spec: dict | None, dtype: str,
                 cpu_kernel: bool = True, device: str = "cpu", enforce_eager: bool = False,
                 tensor_parallel_size: int = 1, max_num_seqs: int = 16) -> None:
        self.name = name
        gc.collect()
        release_freed_memory()          # what earlier engines freed must not count against it
        before = resident_bytes()
        self.llm = LLM(target, speculative_config=spec, device=device, freeze_gc=True,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                       cpu_kernel=cpu_kernel,
                       enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                       **precision_args(dtype))
        after = resident_bytes()
        # this process's share (tensor-parallel workers hold their shards in their own)
        self.resident_mb = None if before is None else (after - before) / 1e6
        self.spec, self.dtype = spec, dtype
        self.tpots: list[float] = []        # ms per decoded token of each request this round

    def run(self, prompts: list[str], max_tokens: int, temperature: float = 0.0,
            first_seed: int = 0) -> list[list[int]]:
        """Output token ids of each prompt, prompt i seeded first_seed + i (its place in the
        suite: every prompt draws its own samples and synthetic acceptances, whatever the
        batch size)."""
        sp = [SamplingParams(temperature=temperature, seed=first_seed + i, max_tokens=max_tokens,
                             ignore_eos=True) for i in range(len(prompts))]
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > 1:
                self.tpots.append(1e3 * (o.metrics["finish_time"] - o.metrics["first_token_time"])
                                  / (n - 1))
        return [o.outputs[0].token_ids for o in outs]

    def tpot_ms(self) -> float | None:
        """The median time per output token after the first over this round's requests."""
        return statistics.median(self.tpots) if self.tpots else None

    def new_round(self) -> None:
        """Forget what earlier rounds taught the drafter (suffix's past responses: the same
        prompts come again) and the prompts' cached prefixes."""
        self.tpots.clear()
        self.llm.engine.reset_proposer()
        self.llm.reset_prefix_cache()

    def acceptance(self) -> tuple[float, float, list[float], float] | None:
        if self.spec is None:
            return None
        m = self.llm.get_stats()
        d = max(1, m["spec_decode_num_drafts"])
        return (m["mean_acceptance_length"], m["acceptance_rate"],
                [a / d for a in m["spec_decode_num_accepted_tokens_per_pos"]],
                m["draft_ms_per_step"])

    def note(self) -> str | None:
        """adaptive_k: the mean K over the steps it chose; hybrid_prompt_lookup: the share of
        drafts that prompt lookup made."""
        m, notes = self.llm.get_stats(), []
        choices = m.get("adaptive_k_choices")
        if choices:
            mean = sum(k * n for k, n in choices.items()) / sum(choices.values())
            notes.append(f"adaptive: mean K {mean:.1f}")
        lookups = m.get("num_lookup_drafts")
        if lookups is not None:
            notes.append(f"lookup drafted {lookups / max(1, m['spec_decode_num_drafts']):.0%}")
        return ", ".join(notes) or None


class TransformersRunner:
    """transformers generate(), assisted generation or prompt lookup (batch 1 only)."""

    def __init__(self, name: str, target: str, draft: str | None, prompt_lookup: int | None,
                 dtype: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        dt = getattr(torch, dtype)
        self.name, self.dtype, self.device = name, dtype, device
        self.tok = AutoTokenizer.from_pretrained(target)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dt).to(device).eval()
        self.kw: dict = {}
        if draft:
            self.kw["assistant_model"] = AutoModelForCausalLM.from_pretrained(
                draft, dtype=dt).to(device).eval()
        if prompt_lookup:
            self.kw["prompt_lookup_num_tokens"] = prompt_lookup

    @torch.inference_mode()
    def run(self, prompts: list[str], max_tokens: int, temperature: float = 0.0,
            first_seed: int = 0) -> list[list[int]]:
        outs = []
        sample = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {
            "do_sample": False}
        for p in prompts:
            ids = torch.tensor([self.tok(p)["input_ids"]], device=self.device)
            out = self.model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      pad_token_id=self.tok.eos_token_id, **sample, **self.kw)
            outs.append(out[0, ids.shape[1]:].tolist())
        return outs

    def new_round(self) -> None:
        pass

    def tpot_ms(self) -> None:
        return None                         # generate() reports no per-token times

    def acceptance(self):
        return None

    def note(self):
        return None
