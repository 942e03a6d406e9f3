"""Draft token trees: parsing, tree attention (each node sees exactly its path), greedy tree
verification (sampled: tests/sampling/test_rejection.py), the engine accepting any branch (KV,
hidden rows and logprobs moved into place), and head proposers drafting trees losslessly."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt
from specserve.config import SpeculativeConfig
from specserve.methods import resolve_speculative_config
from specserve.methods.base import Proposal, ProposerBase
from specserve.models.backend import make_kv_cache
from specserve.models.cpu_backend import use_decode_linears
from specserve.models.loader import load_model
from specserve.models.metadata import build_metadata, build_tree_metadata, tree_rows
from specserve.sampling.rejection import PLACEHOLDER_TOKEN_ID, VerifyRequest, verify
from specserve.token_tree import TokenTree, accepted_path, ancestors
from tests.conftest import DEVICE
from tests.methods.test_heads import eagle3_ckpt, eagle_ckpt, medusa_ckpt, mtp_target

TREE = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def test_tree_parsing_and_config_errors():
    t = TokenTree.parse("[(0, 1), (1,), (0,), (0, 0)]")
    assert t.paths == ((0,), (0, 0), (0, 1), (1,))          # depth-first
    assert t.parents == [-1, 0, 0, -1] and t.ranks == [0, 0, 1, 1] and t.depth == 2
    assert t.truncated(3).paths == ((0,), (0, 0), (0, 1)) and TokenTree.chain(3).is_chain
    assert ancestors([-1, -1, 0, 2], 3) == [0, 2, 3]
    for bad, match in [("[(0, 0)]", "no parent path"), ("[(0,), (0,)]", "twice"),
                       ("[(-1,)]", "ranks >= 0"), ("nonsense(", "could not parse"), ("[]", "got")]:
        with pytest.raises(ValueError, match=match):
            TokenTree.parse(bad)
    cfg = SpeculativeConfig(method="eagle3", model="m", speculative_token_tree=TREE)
    assert cfg.num_speculative_tokens == 6 and cfg.token_tree().parents == [-1, 0, 1, 0, -1, 4]
    assert SpeculativeConfig(method="eagle", model="m", speculative_token_tree="[(0,), (0, 0)]",
                             num_speculative_tokens=2).token_tree() is None     # a chain
    for over, match in [({"method": "ngram"}, "applies to eagle3, eagle, medusa, mtp, not 'ngram'"),
                        ({"num_speculative_tokens": 4}, "must equal the number of nodes"),
                        ({"rejection_sample_method": "synthetic",
                          "synthetic_acceptance_rate": 0.5}, "synthetic"),
                        ({"draft_confidence_threshold": 0.3}, "cannot be combined")]:
        with pytest.raises(ValueError, match=match):
            resolve_speculative_config({"method": "eagle3", "model": "m",
                                        "speculative_token_tree": TREE} | over)


def test_tree_attention_equals_each_path_run_alone(llama_dir, path_kind):
    """One pass over [last, tree nodes] gives every node the logits of its root-to-node path
    fed as a plain sequence, and writes each node's KV rotated for its depth; with a second
    request's smaller tree in the same step (ragged rows)."""
    model = load_model(str(llama_dir), torch.float32, torch.device("cpu"))
    if path_kind == "kernel":
        use_decode_linears(model)
        assert all(layer.cpu_layer is not None for layer in model.layers)
    cache = make_kv_cache(model, 2, 64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 6)]
    trees = [TokenTree.parse(TREE).parents, TokenTree.parse(TREE).truncated(3).parents]
    drafts = [torch.randint(0, 96, (len(p),), generator=g).tolist() for p in trees]
    with torch.inference_mode():
        n = [len(p) - 1 for p in prompts]
        md, pos = build_metadata([0, 0], n, [1, 0], torch.device("cpu"))  # prefill all but one
        model(torch.tensor(prompts[0][:-1] + prompts[1][:-1]), pos, md, cache.layers)
        rows = [tree_rows(k, 1, p, len(d)) for k, p, d in zip(n, trees, drafts)]
        md = build_tree_metadata([1, 0], *[[r[i] for r in rows] for i in (0, 2, 3)],
                                 torch.device("cpu"))
        ids = [t for p, d in zip(prompts, drafts) for t in [p[-1]] + d]
        rope = torch.tensor([x for r in rows for x in r[1]])
        out = model.compute_logits(model(torch.tensor(ids), rope, md, cache.layers))
        tree_logits = out.split([1 + len(d) for d in drafts])
        for prompt, parents, d, logits in zip(prompts, trees, drafts, tree_logits):
            for i in range(len(d)):
                seq = prompt + [d[a] for a in ancestors(parents, i)]
                dense = model.compute_logits(model(torch.tensor([seq]),
                                                   torch.arange(len(seq))[None]))[0, -1]
                torch.testing.assert_close(logits[1 + i], dense, atol=1e-4, rtol=1e-4)
        # the KV of node 5 = (1, 0) sits at position 10 once moved there, as a chain puts it
        prompt, d = prompts[0], drafts[0]
        cache.move(1, [9 + 4, 9 + 5], [9, 10])
        k_chain = make_kv_cache(model, 1, 64)
        seq = prompt + [d[4], d[5]]
        md, pos = build_metadata([0], [len(seq)], [0], torch.device("cpu"))
        model(torch.tensor(seq), pos, md, k_chain.layers)
        for (k, _), (kc, _) in zip(cache.layers, k_chain.layers):
            torch.testing.assert_close(k[1, :, :11], kc[0, :, :11], atol=1e-5, rtol=1e-5)


def test_greedy_tree_verification_follows_the_target():
    # root -> a(5), b(7); a -> c(1), d(2); b -> e(3). Target argmax: after root 7, after b 3,
    # after e 4: accepts b, e and emits 4.
    parents, drafts = [-1, -1, 0, 0, 1], [5, 7, 1, 2, 3]
    logits = torch.full((6, 10), -5.0)
    for row, tok in enumerate([7, 0, 3, 0, 0, 4]):
        logits[row, tok] = 5.0
    r = VerifyRequest(drafts, None, SamplingParams(temperature=0), torch.Generator(), parents)
    chain = VerifyRequest([9], None, SamplingParams(temperature=0), torch.Generator())
    chain_logits = torch.full((2, 10), -5.0)
    chain_logits[0, 9], chain_logits[1, 8] = 5.0, 5.0
    out = verify(torch.cat([logits, chain_logits]), [r, chain])
    assert out[0].tolist() == [7, 3, 4, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]
    assert out[1, :2].tolist() == [9, 8]
    assert accepted_path(parents, drafts, [7, 3, 4]) == [1, 4]
    logits[0] = -5.0
    logits[0, 6] = 5.0                      # no child of the root carries the target's token
    assert verify(logits, [r])[0, 0].item() == 6


class OracleTreeProposer(ProposerBase):
    """Knows each request's greedy continuation and hides it in a tree at changing branches
    (never only on the first-child chain), so the engine must accept non-first branches."""

    def __init__(self, refs: dict[tuple, list[int]], dense_hidden: dict) -> None:
        self.refs, self.dense_hidden, self.steps = refs, dense_hidden, 0
        self.hidden_checked = 0

    def propose(self, batch):
        out = batch.runner_output
        for i, r in enumerate(batch.step_requests):      # the rows of verified positions
            lo, hi = out.rows(i, r.num_computed_tokens)
            want = self.dense_hidden[tuple(r.prompt_token_ids)][out.starts[i]:r.num_computed_tokens]
            torch.testing.assert_close(out.hidden[lo:hi], want, atol=1e-4, rtol=1e-4)
            self.hidden_checked += hi - lo
        props = []
        for r, n in zip(batch.requests, batch.max_num_tokens):
            ref = self.refs[tuple(r.prompt_token_ids)]
            nxt = ref[len(r.output_token_ids):]
            self.steps += 1
            branch = self.steps % 3        # 0: first child right, 1: second, 2: neither
            wrong = [(t + 1) % 96 for t in nxt]
            # root -> x0, y0; x0 -> x1; y0 -> y1
            right, other = (0, 1) if branch == 0 else (1, 0)
            nodes = [None] * 4
            nodes[right], nodes[right + 2] = nxt[0], nxt[1] if len(nxt) > 1 else 0
            nodes[other], nodes[other + 2] = wrong[0], wrong[1] if len(nxt) > 1 else 0
            if branch == 2:
                nodes[right] = (nxt[0] + 2) % 96
            props.append(Proposal(nodes[:n], parents=[-1, -1, 0, 1][:n]))
        return props

    def finish(self, request):
        pass


def test_engine_accepts_any_branch(llama_dir):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 95, (int(n),), generator=g).tolist() for n in (5, 11, 17)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    base = LLM(str(llama_dir), device=DEVICE)
    ref = base.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    refs = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref)}
    model = base.engine.model
    with torch.inference_mode():
        dev = model.embed_tokens.weight.device
        dense = {tuple(p): model(torch.tensor([p + refs[tuple(p)]], device=dev),
                                 torch.arange(len(p) + 20, device=dev)[None])[0] for p in prompts}
    llm = LLM(str(llama_dir), device=DEVICE, speculative_config={"method": "ngram",
                                                              "num_speculative_tokens": 4})
    oracle = OracleTreeProposer(refs, dense)
    llm.engine.proposer = oracle
    got = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                       use_tqdm=False)
    for o, r in zip(got, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    m = llm.get_stats()
    # right branch taken 2 of 3 steps: about 2 accepted tokens per step when it is
    assert m["spec_decode_num_accepted_tokens"] > m["spec_decode_num_drafts"]
    per_node = m["spec_decode_num_accepted_tokens_per_node"]
    assert sum(per_node) == m["spec_decode_num_accepted_tokens"] and min(per_node[:4]) > 0
    assert oracle.hidden_checked > 40


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "mtp"])
def test_head_trees_are_lossless(method, llama_dir, tmp_path):
    target = str(mtp_target(tmp_path / "t")) if method == "mtp" else str(llama_dir)
    spec = {"method": method, "speculative_token_tree": TREE}
    if method != "mtp":
        make = {"eagle": eagle_ckpt, "eagle3": eagle3_ckpt, "medusa": medusa_ckpt}[method]
        spec["model"] = str(make(tmp_path / "h"))
    g = torch.Generator().manual_seed(4)
    ps = [TokensPrompt(prompt_token_ids=torch.randint(0, 95, (int(n),), generator=g).tolist())
          for n in (4, 9, 15, 22)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(target, device=DEVICE).generate(
        ps, greedy, use_tqdm=False)]
    llm = LLM(target, device=DEVICE, max_num_batched_tokens=40, speculative_config=spec)
    seen, propose = [], llm.engine.proposer.propose

    def recording(batch):
        out = propose(batch)
        seen.extend(out)
        return out
    llm.engine.proposer.propose = recording
    sampled = SamplingParams(temperature=0.9, seed=2, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(ps, [greedy, sampled] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == ref[::2]
    assert len(mixed[1].outputs[0].token_ids) == 12
    assert any(p.parents == [-1, 0, 1, 0, -1, 4] for p in seen)     # the tree, for all requests
    assert all(p.parents is not None for p in seen if len(p.token_ids) > 3)   # 3: a chain
    for p in seen:
        if p.parents:                         # siblings carry distinct tokens
            kids = {}
            for t, par in zip(p.token_ids, p.parents):
                assert t not in kids.setdefault(par, set())
                kids[par].add(t)


def test_medusa_tree_deeper_than_its_heads_is_an_error(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="3 deep but this medusa checkpoint predicts 2 tokens"):
        LLM(str(llama_dir), device=DEVICE, speculative_config={
            "model": str(medusa_ckpt(tmp_path / "m", heads=2)), "speculative_token_tree": TREE})


def test_best_trees_from_node_rates():
    from specserve.bench.tree import best_trees, measurement_tree
    tree = measurement_tree(3, 1)              # ranks summing to <= 1, depth <= 3: 9 nodes
    assert len(tree) == 9 and tree.paths[:3] == ((0,), (0, 0), (0, 0, 0))
    rate = {(0,): .8, (0, 0): .6, (0, 0, 0): .4, (0, 0, 1): .1, (0, 1): .1, (0, 1, 0): .1,
            (1,): .1, (1, 0): .05, (1, 0, 0): 0.0}
    rows = best_trees(tree, [rate[p] for p in tree.paths], [3, 5, 9])
    assert rows[0][2].paths == ((0,), (0, 0), (0, 0, 0)) and abs(rows[0][1] - 2.8) < 1e-9
    # ties at 0.1: shallower first, so (0, 1) comes before its child (0, 1, 0)
    assert rows[1][2].paths == ((0,), (0, 0), (0, 0, 0), (0, 1), (1,))
    assert rows[2][0] == 8                     # the never-accepted node is left out
