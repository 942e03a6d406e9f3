"""The drafting methods: REGISTRY is the one list of them. Everything else (config checks, the
engine, training, benchmarks, the CLI) asks it instead of naming methods."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from torch import nn

from specserve.config import SpeculativeConfig
from specserve.methods import (
    custom_class,
    dflash,
    draft_model,
    eagle,
    eagle3,
    extract_hidden_states,
    medusa,
    mlp_speculator,
    mtp,
    ngram,
    suffix,
)
from specserve.methods.base import (
    DraftContext,
    MethodSpec,
    Proposal,
    ProposeBatch,
    Proposer,
    RunnerOutput,
)
from specserve.methods.hybrid import HybridProposer
from specserve.models.backend import Backend
from specserve.models.catalogue import (
    bundled_drafters,
    catalogue_name,
    hub_name,
    is_reference,
    resolve_model,
)

__all__ = ["REGISTRY", "DraftContext", "MethodSpec", "Proposal", "ProposeBatch", "Proposer",
           "RunnerOutput", "build_proposer", "detect_method", "get", "head_methods", "load_head",
           "resolve", "resolve_speculative_config"]

logger = logging.getLogger("specserve")

# Detection checks methods in this order (eagle3 before eagle: "eagle3" contains "eagle").
REGISTRY: dict[str, MethodSpec] = {s.name: s for s in (
    ngram.SPEC, suffix.SPEC, draft_model.SPEC, eagle3.SPEC, eagle.SPEC, medusa.SPEC,
    mlp_speculator.SPEC, mtp.SPEC, dflash.SPEC, custom_class.SPEC, extract_hidden_states.SPEC)}


def get(name: str) -> MethodSpec:
    for spec in REGISTRY.values():
        if name == spec.name or name in spec.aliases:
            return spec
    raise ValueError(f"speculative_config method {name!r} is not known; use one of "
                     f"{', '.join(REGISTRY)}")


def sharded_methods() -> tuple[str, ...]:
    """Methods whose drafter draft_tensor_parallel_size > 1 shards like the target."""
    return tuple(name for name, spec in REGISTRY.items() if spec.shards)


def head_methods() -> tuple[str, ...]:
    """Methods with a trainable head on the target (`specserve train <method>`)."""
    return tuple(n for n, s in REGISTRY.items() if s.new_head is not None)


def _has_mtp_layers(target: str | None) -> bool:
    """Whether a target directory's config counts MTP layers of its own."""
    return bool(target is not None and (Path(target) / "config.json").is_file()
                and mtp.SPEC.default_k(target))


def detect_method(model: str | None, target: str | None = None) -> str:
    """The method, in vLLM's order: a dotted import path is a custom class; "ngram" is ngram;
    a checkpoint by its config.json (speculators_model_type, model_type, architectures), then
    its directory name; no model with a target that has MTP layers is mtp; a plain LM is a
    draft model."""
    if model is None:
        if _has_mtp_layers(target):
            return mtp.SPEC.name
        raise ValueError("speculative_config needs 'method' (one of "
                         f"{', '.join(REGISTRY)}) or 'model'")
    if model == "ngram":
        return ngram.SPEC.name
    if custom_class.is_dotted_path(model) and not Path(model).exists():
        return custom_class.SPEC.name
    hints = [hub_name(model).lower()]       # a Hub cache's repository name, not its hash
    cfg_path = Path(model) / "config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
        hints = [str(cfg.get("speculators_model_type", "")), str(cfg.get("model_type", "")),
                 *map(str, cfg.get("architectures") or [])] + hints
    for hint in hints:
        for spec in REGISTRY.values():
            if spec.reads_hidden_states and any(k in hint.lower() for k in spec.detect):
                return spec.name
    return draft_model.SPEC.name


# method "auto" picks the first of these it finds for the target (the selection guide: a head
# trained on the target's own outputs first, a draft model after, lookup when there is none)
AUTO_ORDER = ("eagle3", "mtp", "dflash", "eagle", "draft_model", "medusa", "mlp_speculator")
AUTO_K = 5          # its K when none is given and the drafter's checkpoint gives none
# A drafter that drafts token by token stops where it is unsure, so the larger K costs its
# extra passes only where they are likely accepted (measured: benchmarks/README, SmolLM2)
AUTO_CONFIDENCE = 0.3


def _choose_auto(config: SpeculativeConfig, target: str | None) -> None:
    """method "auto": the drafter available for `target` (a `model` given, the target's own MTP
    layers, a drafter bundled for it, else prompt lookup), with prompt lookup for the requests
    that copy and K chosen per step from measured acceptance and step times (0 = plain decoding
    when nothing pays); the choice and its reason in `auto_choice`."""
    name = catalogue_name(target) if target else None
    bundled = {b.removeprefix(f"{name}-"): b for b in bundled_drafters(name)} if name else {}
    if config.model:
        config.method = detect_method(config.model, target)
        why = f"{config.method}: the drafter given ({config.model})"
    elif _has_mtp_layers(target):
        config.method, why = mtp.SPEC.name, "mtp: the target's own MTP layers"
    elif any(m in bundled for m in AUTO_ORDER):
        config.method = next(m for m in AUTO_ORDER if m in bundled)
        config.model = resolve_model(bundled[config.method])
        why = f"{config.method}: {bundled[config.method]}, bundled for this target"
    else:
        config.method, why = ngram.SPEC.name, "ngram: no drafter for this target"
    if config.method != ngram.SPEC.name:
        config.hybrid_prompt_lookup = config.hybrid_prompt_lookup or 2
        why += ", prompt lookup for requests that repeat their context"
    if (get(config.method).steps_drafts and not config.draft_confidence_threshold
            and config.speculative_token_tree is None and not config.parallel_drafting):
        config.draft_confidence_threshold = AUTO_CONFIDENCE
        why += f", drafting stopped below confidence {AUTO_CONFIDENCE}"
    config.adaptive_k = True
    config.auto_choice = why + "; K per step from measured acceptance and step times"


def resolve(config: SpeculativeConfig, target: str | None = None) -> SpeculativeConfig:
    """Settle and check what depends on the method (in place; calling it again is a no-op):
    the method detected when omitted, its required model, K from its checkpoint when omitted,
    keys that belong to other methods. `target`: the target's directory (MTP's checkpoint)."""
    if config.model and is_reference(config.model):
        config.model = resolve_model(config.model)      # a catalogue name, a Hub id
    if config.method == "auto":
        _choose_auto(config, target)
    if config.method is None:
        config.method = detect_method(config.model, target)
    if config.method == ngram.SPEC.name and config.model == "ngram":
        config.model = None                 # vLLM's form: model "ngram" names the method
    spec = get(config.method)
    config.method = spec.name
    if spec.needs_model and not config.model:
        raise ValueError(f"speculative_config method {spec.name!r} needs 'model': the path of "
                         "the draft model or head directory")
    if spec.configure is not None:            # its own keys (and defaults, K among them)
        spec.configure(config)
    checkpoint = config.model or (target if spec.model_is_target else None)
    # a recurrent drafter's checkpoint K is only a default: read when K is not given
    n_predict = (spec.default_k(checkpoint)
                 if spec.default_k is not None and checkpoint is not None
                 and (config.num_speculative_tokens is None or not spec.recurrent) else None)
    if config.num_speculative_tokens is None:
        # "auto" takes AUTO_K where its drafter's checkpoint gives no K
        config.num_speculative_tokens = n_predict or (AUTO_K if config.auto_choice else None)
        if config.num_speculative_tokens is None:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (an int > 0)"
                             + (f"; {checkpoint} does not give one" if spec.default_k else ""))
    config.check_k()
    k = config.num_speculative_tokens
    # vLLM's rule for a chain (a tree's depth is checked by its proposer): the layers run in turn
    if (n_predict and k > n_predict and config.speculative_token_tree is None
            and spec.reads_hidden_states and not spec.recurrent):
        if not spec.repeats_layers:
            raise ValueError(f"num_speculative_tokens={k} is more than the {n_predict} tokens "
                             f"this {spec.name} checkpoint predicts, and its stages cannot run "
                             f"in turn (it predicts {n_predict} tokens; set "
                             f"num_speculative_tokens <= {n_predict})")
        if k % n_predict:
            raise ValueError(f"num_speculative_tokens={k} is more than the {n_predict} tokens "
                             f"this {spec.name} checkpoint predicts, and not a multiple of it; "
                             f"give {n_predict} or a multiple")
        logger.warning("num_speculative_tokens=%d is %dx the %d this %s checkpoint predicts: "
                       "its layers run in turn and later drafts are accepted less (vLLM warns "
                       "the same)", k, k // n_predict, n_predict, spec.name)
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    for other in REGISTRY.values():
        if other is spec:
            continue
        for key in other.keys:
            if getattr(config, key) != defaults[key]:
                raise ValueError(f"{key} applies to method {other.name!r} only")
    config.synthetic_rates()                  # checks the synthetic schedule now that K is known
    _capability(config.speculative_token_tree is not None, spec, "drafts_trees",
                "speculative_token_tree")
    _capability(bool(config.draft_confidence_threshold), spec, "steps_drafts",
                "draft_confidence_threshold")
    _capability(config.draft_sample_method == "probabilistic", spec, "samples_drafts",
                "draft_sample_method 'probabilistic'")
    _capability(config.parallel_drafting, spec, "drafts_in_parallel",
                "parallel_drafting")
    if (config.rejection_sample_method == "probabilistic"
            and config.draft_sample_method != "probabilistic"):
        raise ValueError("rejection_sample_method 'probabilistic' tests drafts against the "
                         "probabilities they were sampled with: set draft_sample_method "
                         "'probabilistic' (draft_model), or use 'strict'")
    model_based = spec.needs_model or spec.reads_hidden_states
    if config.hybrid_prompt_lookup is not None and not model_based:
        raise ValueError(f"hybrid_prompt_lookup adds prompt lookup to a model-based drafter, "
                         f"not to {spec.name!r}; for prompt lookup alone use method 'ngram'")
    return config


def _capability(used: bool, spec: MethodSpec, flag: str, key: str) -> None:
    if used and not getattr(spec, flag):
        able = ", ".join(n for n, s in REGISTRY.items() if getattr(s, flag))
        raise ValueError(f"{key} applies to {able}, not {spec.name!r}")


def resolve_speculative_config(data: dict | SpeculativeConfig,
                               target: str | None = None) -> SpeculativeConfig:
    """`speculative_config` as a user gives it -> a checked SpeculativeConfig."""
    return resolve(SpeculativeConfig.from_dict(data), target)


def load_head(method: str, path: str, target: nn.Module, device: torch.device,
              dtype: torch.dtype, cpu_kernel: bool = True) -> nn.Module:
    """A method's head read from its checkpoint, ready for inference on `device` in `dtype`."""
    return Backend(device, dtype, cpu_kernel).prepare(get(method).read(path, target))


def build_proposer(config: SpeculativeConfig, ctx: DraftContext) -> Proposer:
    spec = get(resolve(config, ctx.target_path).method)
    drafter = spec.build(config, ctx)
    if config.hybrid_prompt_lookup is None:
        return drafter
    return HybridProposer(drafter, config.hybrid_prompt_lookup)
