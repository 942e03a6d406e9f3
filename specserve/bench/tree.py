"""`specserve bench tree`: which `speculative_token_tree` to give a drafter.

Drafts a large tree (every path up to `--max-depth` deep whose child ranks sum to at most
`--max-rank-sum`) on held-out prompts and counts how often each node lies on the accepted path.
The best tree of n nodes is then the n nodes accepted most often: a child is never accepted
more often than its parent, so they always form a tree, and its expected mean acceptance
length is 1 + the sum of their rates (Medusa and EAGLE choose static trees this way). What a
node costs (a verify row, a head pass per level) depends on the machine: take the sizes printed
here to `specserve bench latency --methods M,M+tree --token-tree ...` to time them.
"""

from __future__ import annotations

import argparse
import itertools

from specserve import methods
from specserve.bench import report
from specserve.bench.methods import prompt_set, spec_config
from specserve.bench.probes import machine
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.token_tree import TokenTree


def measurement_tree(max_depth: int, max_rank_sum: int) -> TokenTree:
    return TokenTree(tuple(sorted(
        p for d in range(1, max_depth + 1)
        for p in itertools.product(range(max_rank_sum + 1), repeat=d) if sum(p) <= max_rank_sum)))


def node_rates(model: str, spec: dict, prompts: list[str], max_tokens: int, temperature: float,
               dtype: str, device: str = "cpu") -> list[float]:
    """Per node of spec's tree: accepted steps / verify steps."""
    llm = LLM(model, speculative_config=spec, dtype=dtype, device=device, freeze_gc=True)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                             ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    m = llm.get_stats()
    per_node = m.get("spec_decode_num_accepted_tokens_per_node", [])
    n = len(TokenTree.parse(spec["speculative_token_tree"]))
    return [c / max(1, m["spec_decode_num_drafts"]) for c in per_node + [0] * (n - len(per_node))]


def best_trees(tree: TokenTree, rates: list[float], sizes: list[int]
               ) -> list[tuple[int, float, TokenTree]]:
    """(size, expected mean acceptance length, tree) for each size: the nodes accepted most
    often (ties: shallower first, so a parent always precedes its equally-rated child)."""
    order = sorted(range(len(rates)), key=lambda i: (-rates[i], len(tree.paths[i]), tree.paths[i]))
    order = [i for i in order if rates[i] > 0]
    out = []
    for n in sizes:
        pick = order[:n]
        out.append((len(pick), 1 + sum(rates[i] for i in pick),
                    TokenTree.parse([tree.paths[i] for i in pick])))
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="specserve bench tree", description=__doc__)
    p.add_argument("mode", choices=["tree"])
    p.add_argument("--target", default="models/code-target")
    p.add_argument("--method", default="eagle3",
                   choices=[n for n, s in methods.REGISTRY.items() if s.drafts_trees])
    p.add_argument("--model", default=None, help="head directory (default: the zoo's)")
    p.add_argument("--max-depth", type=int, default=6)
    p.add_argument("--max-rank-sum", type=int, default=2)
    p.add_argument("--sizes", default="4,6,8,10,12,16")
    p.add_argument("--prompt-sets", default="completion,editing")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--title", default="Draft tree nodes: acceptance and best trees")
    report.add_output_args(p)
    a = p.parse_args(argv)
    tree = measurement_tree(a.max_depth, a.max_rank_sum)
    model, spec = spec_config(a.method, 1, a.target, "")
    spec = {k: v for k, v in spec.items() if k != "num_speculative_tokens"}
    if a.model:
        model, spec = (a.model, spec) if a.method == "mtp" else (model, spec | {"model": a.model})
    spec["speculative_token_tree"] = str([list(q) for q in tree.paths])
    sets = a.prompt_sets.split(",")
    rates = [0.0] * len(tree)
    for name in sets:
        r = node_rates(model, spec, prompt_set(name, a.num_prompts, a.target), a.max_tokens,
                       a.temperature, a.dtype, a.device)
        print(f"{name}: tau of the whole {len(tree)}-node tree {1 + sum(r):.2f}", flush=True)
        rates = [x + y / len(sets) for x, y in zip(rates, r)]
    rows = best_trees(tree, rates, [int(n) for n in a.sizes.split(",")])
    table = ["| nodes | expected tau | speculative_token_tree |", "|---:|---:|---|"]
    table += [f"| {n} | {tau:.2f} | `{[tuple(q) for q in t.paths]}` |" for n, tau, t in rows]
    print("\n".join(table))
    data = {"benchmark": "tree", "title": a.title, "command": "specserve bench " + " ".join(argv),
            "machine": machine(device=a.device),
            "settings": {"method": a.method, "target": a.target, "prompt_sets": sets,
                         "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
                         "temperature": a.temperature, "measured_nodes": len(tree),
                         "max_depth": a.max_depth, "max_rank_sum": a.max_rank_sum},
            "node_paths": [list(q) for q in tree.paths], "node_rates": rates,
            "rows": [{"nodes": n, "expected_tau": tau, "tree": str([tuple(q) for q in t.paths])}
                     for n, tau, t in rows]}
    print(report.save(data, a.out, a.publish))
