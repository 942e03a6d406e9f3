"""What the benchmarks compare: speculation methods as (model, speculative_config) pairs, and the
flags both benchmark commands share."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve import methods
from specserve.bench import random_models
from specserve.data.prompts import CHAT_SETS, PROMPT_SETS
from specserve.data.zoo import head_dir
from specserve.models.catalogue import CATALOGUE, resolve_model
from specserve.models.loader import load_tokenizer


def drafter_dir(target: str, method: str) -> str:
    """`method`'s drafter for `target`: bundled under the method's own name for a catalogue
    target (smollm2-135m-instruct-mlp_speculator), else the zoo's head beside it."""
    return f"{target}-{method}" if target in CATALOGUE else head_dir(target, method)


def spec_config(method: str, k: int, target: str, draft: str) -> tuple[str, dict]:
    """The model a benchmark loads for `method` and its speculative_config with K = k."""
    if method == "auto":        # it finds its drafter and its K itself, as a user's "auto" does
        return target, {"method": "auto"}
    try:
        m = methods.get(method)
    except ValueError:
        raise SystemExit(f"unknown method {method!r}; choose from "
                         f"{', '.join(methods.REGISTRY)}") from None
    spec = {"method": m.name, "num_speculative_tokens": k} | m.suggested
    if m.model_is_target and Path(target).is_dir():   # the zoo's target with its head in it
        return head_dir(target, m.name), spec
    if m.model_is_target:                       # a layer written beside a GGUF target
        return target, spec | {"model": drafter_dir(target, m.name)}
    if m.reads_hidden_states:                   # the zoo's head for the target
        return target, spec | {"model": drafter_dir(target, m.name)}
    if m.needs_model:
        return target, spec | {"model": draft}
    return target, spec


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="models/code-target",
                   help="a model directory, or random weights of a real shape: "
                        f"random:{'|'.join(random_models.SHAPES)} or "
                        "random:hidden=H,layers=L,inter=I,heads=A,kv=G[,head_dim=D] (built once "
                        "under runs/random/ with the bundled tokenizer; pair it with "
                        "--spec-extra '{\"rejection_sample_method\": \"synthetic\", "
                        "\"synthetic_acceptance_rate\": 0.8}'), or padded:DIR,inter=N: DIR's "
                        "model with MLPs widened by columns that add nothing (the same output, "
                        "a real model's bytes per step; DIR's heads draft for it as for DIR)")
    p.add_argument("--draft", default="models/code-draft", help="as --target")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--methods", default="available",
                   help="comma-separated, from " + ", ".join(methods.REGISTRY)
                        + "; default: every method "
                        "whose draft or head exists (heads at <target>-<method>); METHOD@DIR "
                        "takes the draft or head from DIR (compare two heads side by side); "
                        "suffixes, combinable: METHOD+tree drafts the --token-tree (eagle, "
                        "eagle3, medusa, mtp), METHOD+parallel drafts in one pass (draft_model: "
                        "PARD, the draft at <draft>-pard; eagle3: P-EAGLE, the head at "
                        "<target>-eagle3-parallel; unless @DIR), METHOD+k=N drafts N tokens, "
                        "METHOD+conf=P sets "
                        "draft_confidence_threshold P (draft_model, eagle, eagle3, mtp), "
                        "METHOD+lookup=N sets hybrid_prompt_lookup N (model-based methods), "
                        "METHOD+int8 quantizes the drafter (speculative quantization), "
                        "METHOD+adaptive chooses K per step up to K (adaptive_k), "
                        "e.g. eagle3+k=8+conf=0.2, eagle3+lookup=4, eagle3+k=6+adaptive")
    p.add_argument("--token-tree", default=None,
                   help="speculative_token_tree for the METHOD+tree entries of --methods, e.g. "
                        "\"[(0,), (1,), (0, 0), (0, 0, 0)]\"; K is its number of nodes")
    p.add_argument("--spec-extra", default=None,
                   help="JSON merged into every speculative_config, e.g. "
                        "'{\"disable_by_batch_size\": 8}'")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: where specserve (and transformers) run")
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16, int8 (bfloat16 weights quantized at load) or a "
                        "llama.cpp block type (q8_0, q4_1, q4_0: loaded in float32, so that "
                        "a GGUF of that type keeps its blocks); bench latency takes a "
                        "comma-separated list and "
                        "runs no-spec and every method in each (speedups against the first "
                        "dtype's no-spec, greedy output compared within a dtype)")


def _suffix_config(name: str, suffix: str, token_tree: str | None) -> dict:
    """The speculative_config keys of one +suffix of a --methods entry."""
    key, eq, value = suffix.partition("=")
    if suffix == "tree":
        if not token_tree:
            raise SystemExit(f"{name!r}: '+tree' needs --token-tree")
        return {"speculative_token_tree": token_tree}
    if suffix == "parallel":
        return {"parallel_drafting": True}
    if suffix == "int8":
        return {"quantization": "int8"}
    if suffix == "adaptive":
        return {"adaptive_k": True}
    try:
        if key == "k" and eq:
            return {"num_speculative_tokens": int(value)}
        if key == "conf" and eq:
            return {"draft_confidence_threshold": float(value)}
        if key == "lookup" and eq:
            return {"hybrid_prompt_lookup": int(value)}
    except ValueError:
        pass
    raise SystemExit(f"{name!r}: unknown suffix {'+' + suffix!r}; use +tree (with --token-tree), "
                     "+parallel, +int8 (the drafter quantized), +adaptive (adaptive_k), +k=N, "
                     "+conf=P or +lookup=N")


def resolve_models(a: argparse.Namespace, tokenizer_dir: str = "models/code-target"
                   ) -> tuple[str, str]:
    """--target and --draft made model directories (random:... built on first use); returns
    them as given, which a run records."""
    given = a.target, a.draft
    a.target = random_models.resolve(a.target, tokenizer_dir)
    a.draft = random_models.resolve(a.draft, tokenizer_dir)
    return given


def configs(a: argparse.Namespace) -> dict[str, tuple[str, dict]]:
    """method name -> (model to load, speculative_config), from the common flags."""
    extra = json.loads(a.spec_extra) if a.spec_extra else {}
    names = (tuple(n for n, s in methods.REGISTRY.items() if s.in_benchmarks)
             + ("draft_model+parallel", "eagle3+parallel")
             if a.methods == "available" else tuple(filter(None, a.methods.split(","))))
    out = {}
    for name in names:
        m, _, path = name.partition("@")
        m, *suffixes = m.split("+")
        model, spec = spec_config(m, a.num_speculative_tokens, a.target, a.draft)
        for suffix in suffixes:
            spec = spec | _suffix_config(name, suffix, a.token_tree)
        if "speculative_token_tree" in spec:
            spec.pop("num_speculative_tokens")
        uses = methods.get("ngram" if m == "auto" else m)
        if path and not (uses.needs_model or uses.reads_hidden_states):
            raise SystemExit(f"{m} drafts without a model; drop '@{path}'")
        if "parallel" in suffixes and not path:     # the zoo's parallel draft or head
            path = (f"{a.draft}-pard" if m == "draft_model"
                    else f"{drafter_dir(a.target, m)}-parallel")
        if path:
            model, spec = (path, spec) if uses.model_is_target else (model, spec | {"model": path})
        needed = Path(spec.get("model", model))
        if a.methods == "available" and not (needed / "config.json").is_file():
            continue
        out[name] = (model, spec | extra)
    return out


def prompt_set(name: str, num: int, target: str) -> list[str]:
    """`num` prompts of the set `name`, a chat set's rendered through `target`'s chat template
    (its drafters were trained on answers to templated user messages)."""
    prompts = PROMPT_SETS[name](num)
    if name not in CHAT_SETS:
        return prompts
    tok = load_tokenizer(resolve_model(target))
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
