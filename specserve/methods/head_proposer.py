"""The proposer of EAGLE, EAGLE-3 and MTP: a one-layer head with its own KV cache, driven by
target features.

Head position p holds the pair (state at p, token at p+1). Every step the head ingests, for
every request the target just ran (prompt chunks included), the pairs of the positions the
target has verified since: (target hidden at p, token p+1). Its output at the last verified
position drafts the first token; each further draft feeds (head output, last draft) at the next
position. Positions written while drafting are overwritten by the next step's target pairs, so
rollback is just the count of verified positions, as for the target. On the CPU kernel the
ingest pass and the greedy chain run in one C call (`HeadChain.after_ingest`) when the step's
rows fit the kernel.

With `parallel_drafting` (P-EAGLE) each drafting request's ingest rows continue, in the same
pass, with K-1 mask rows (the mask token on the head's learned mask state): the outputs of its
last pair and of the masks give all K drafts. The masks' KV lies past the verified positions,
where the next step's pairs are written before anything reads it. On the CPU kernel that pass
is the C chain's ingest, each of the K rows a chain of one draft (greedy drafting).

While no request drafts (K = 0 by `disable_by_batch_size` or `adaptive_k`), ingestion waits:
the target features of each step are kept per request and fed in one pass when drafting
resumes, or once a request has `MAX_PENDING` of them (bounding the memory they hold).
"""

from __future__ import annotations

import itertools

import torch

from specserve.config import SpeculativeConfig
from specserve.kernels.cpu import max_rows
from specserve.methods.base import DraftContext, Proposal, ProposeBatch, ProposerBase
from specserve.methods.parallel import drafts_from_rows
from specserve.models.heads import StatefulHead
from specserve.models.layers import Rotary, model_tensor
from specserve.models.metadata import build_tree_metadata, ragged_inputs
from specserve.token_tree import ancestors, node_depths


class HeadProposer(ProposerBase):
    # Positions of target features a request may hold back (256 x 3 x 384 float32 = 1.2 MB for
    # the bundled EAGLE-3, a tenth of its target's KV slot). Features of a request that ends
    # before drafting resumes are never ingested, so a larger bound saves more work under load.
    MAX_PENDING = 256

    def __init__(self, config: SpeculativeConfig, ctx: DraftContext, head: StatefulHead) -> None:
        max_len = ctx.max_model_len + config.num_speculative_tokens + 1
        self.head = (ctx.backend.prepare(head) if ctx.shard_head is None
                     else ctx.shard_head(head, max_len))
        a = self.head.args
        self.head.rotary = Rotary(a.head_dim, max_len, a.rope_theta, a.rope_scaling).to(
            ctx.device)
        self.num_layers = self.head.num_step_layers      # taking turns over the draft steps
        for step in range(self.num_layers):
            self.head.step_head(step).rotary = self.head.rotary
        self.cache = ctx.new_kv_cache(self.num_layers, a.num_key_value_heads // self.head.tp_size,
                                      max_len, a.head_dim, model_tensor(self.head).dtype)
        self.caches = [self.cache]
        self.modules = {"head": self.head}
        self.device = ctx.device
        self.threshold = config.draft_confidence_threshold
        self.tree = config.token_tree()             # None: draft a chain
        self.parallel = config.parallel_drafting
        if self.parallel and self.tree is not None:
            raise ValueError("parallel_drafting drafts a chain in one pass; drop "
                             "speculative_token_tree (or parallel_drafting)")
        if self.parallel:                       # the mask rows' state, fixed at inference
            with torch.inference_mode():
                self.mask_state = self.head.mask_state()                      # [1, H]
        self.aux_hidden_layers = tuple(getattr(self.head, "aux_layers", ()))
        # greedy chains (and P-EAGLE's pass) in one compiled call where the head has one (on
        # the CPU kernel)
        self.chain = (ctx.backend.chain(self.head, self.cache.layers)
                      if self.tree is None and self.num_layers == 1 else None)
        # greedy chains replayed from CUDA graphs (on CUDA, where the head is not sharded)
        self.graphs = (ctx.backend.head_graphs(self.head, self.cache, ctx.num_slots)
                       if self.tree is None and ctx.shard_head is None else None)
        self.num_verified: dict[str, int] = {}      # head positions holding target pairs
        # request id -> target feature rows [n, F] for the positions after num_verified
        self.pending: dict[str, list[torch.Tensor]] = {}
        self.num_seen: dict[str, int] = {}          # num_verified + pending rows

    def _run(self, reqs, token_lists, h: torch.Tensor, starts: list[int],
             step: int = 0) -> torch.Tensor:
        """Draft step `step`'s head (0: the target-fed one) over the pairs (h, token)."""
        ids, positions, md = ragged_inputs(token_lists, starts, [r.slot for r in reqs],
                                           self.device)
        return self.head.step_head(step)(ids, h, positions, md,
                                         self.cache.layers[step % self.num_layers])  # [T, H]

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        out = batch.runner_output
        feats = out.aux_hidden if self.aux_hidden_layers else out.hidden    # [T, F]
        reqs, tokens, rows, starts = [], [], [], []
        for i, r in enumerate(batch.step_requests):
            if r.is_finished:
                continue
            rid = r.request_id
            start = self.num_verified.get(rid, 0)
            held = self.pending.setdefault(rid, [])
            assert self.num_seen.get(rid, 0) == out.starts[i], "the head saw every step"
            self.num_seen[rid] = r.num_computed_tokens
            lo, hi = out.rows(i, r.num_computed_tokens)
            if not batch.requests and r.num_computed_tokens - start < self.MAX_PENDING:
                held.append(feats[lo:hi].clone())    # outlives this step's feature tensor
                continue
            held.append(feats[lo:hi])
            reqs.append(r)
            tokens.append(r.all_token_ids[start + 1:r.num_computed_tokens + 1])
            rows.append(held[0] if len(held) == 1 else torch.cat(held))
            starts.append(start)
            self.num_verified[rid] = r.num_computed_tokens
            del self.pending[rid]
        if not reqs:
            return []
        h = self.head.fuse_target(torch.cat(rows))                            # [T, H]
        ends = [e - 1 for e in itertools.accumulate(len(t) for t in tokens)]  # last rows
        drafting = batch.requests
        if self.parallel and drafting:
            return self._propose_parallel(reqs, tokens, h, starts, drafting,
                                          batch.max_num_tokens)
        if (drafting and self.chain is not None
                and max(len(drafting), len(h)) <= max_rows(self.chain.lib)):
            end = {id(r): e for r, e in zip(reqs, ends)}
            return [Proposal(t) for t in self.chain.after_ingest(
                [t for ts in tokens for t in ts], h,
                [r.slot for r, ts in zip(reqs, tokens) for _ in ts],
                [p + i for p, ts in zip(starts, tokens) for i in range(len(ts))],
                [end[id(r)] for r in drafting], [r.num_tokens - 1 for r in drafting],
                [r.slot for r in drafting], batch.max_num_tokens, self.threshold)]
        head_out = self._run(reqs, tokens, h, starts)
        last = {id(r): head_out[e] for r, e in zip(reqs, ends)}
        if not drafting:
            return []
        state = torch.stack([last[id(r)] for r in drafting])               # [B, H]
        if self.tree is not None:
            return self._draft_trees(drafting, batch.max_num_tokens, state)
        if self.graphs is not None and not self.threshold:
            k, bases = max(batch.max_num_tokens), [r.num_tokens - 2 for r in drafting]
            if self.graphs.fits(len(drafting), max(bases) + k - 1):
                chains = self.graphs.run(state, bases, [r.slot for r in drafting], k)
                return [Proposal(d[:n]) for d, n in zip(chains, batch.max_num_tokens)]
        if self.chain is not None and len(drafting) <= max_rows(self.chain.lib):   # long ingest
            return [Proposal(t) for t in self.chain(state, [r.num_tokens - 1 for r in drafting],
                                                    [r.slot for r in drafting],
                                                    batch.max_num_tokens, self.threshold)]
        drafts: list[list[int]] = [[] for _ in drafting]
        active = list(range(len(drafting)))
        for step in itertools.count():
            head = self.head.step_head(step)
            if self.threshold:
                toks, conf = head.greedy_tokens_with_prob(state)
                sure = (conf >= self.threshold).tolist()
            else:
                toks, sure = head.greedy_tokens(state), [True] * len(active)
            for j, t in zip(active, toks.tolist()):
                drafts[j].append(t)
            keep = [n for n, j in enumerate(active)
                    if sure[n] and len(drafts[j]) < batch.max_num_tokens[j]]
            if not keep:
                break
            active = [active[n] for n in keep]
            state = state[keep]
            sub = [drafting[j] for j in active]
            state = self._run(sub, [[drafts[j][-1]] for j in active], state,
                              [r.num_tokens - 2 + len(drafts[j]) for r, j in zip(sub, active)],
                              step + 1)
        return [Proposal(d) for d in drafts]

    def _propose_parallel(self, reqs, tokens: list[list[int]], h: torch.Tensor,
                          starts: list[int], drafting, budgets: list[int]) -> list[Proposal]:
        """One head pass: every request's new pairs, each drafting request's followed by its
        budget-1 mask rows; its last pair's row and its mask rows draft."""
        masks = {id(r): n - 1 for r, n in zip(drafting, budgets)}
        toks, states, rows, lo, n = [], [], {}, 0, 0     # n: rows so far, pairs and masks
        for r, ts in zip(reqs, tokens):
            m = masks.get(id(r), 0)
            toks.append(ts + [self.head.mask_token_id] * m)
            states += [h[lo:lo + len(ts)], self.mask_state.expand(m, -1)]
            lo, n = lo + len(ts), n + len(ts) + m
            rows[id(r)] = range(n - m - 1, n)                     # its last pair, its masks
        picked = [i for r in drafting for i in rows[id(r)]]
        states = torch.cat(states)                                           # [n, H]
        if self.chain is not None and not self.threshold and n <= max_rows(self.chain.lib):
            # The C chain's ingest is this pass; each picked row is a chain of one draft (its
            # greedy token, nothing fed after it).
            positions = [p + i for p, ts in zip(starts, toks) for i in range(len(ts))]
            flat = [d for (d,) in self.chain.after_ingest(
                [t for ts in toks for t in ts], states,
                [r.slot for r, ts in zip(reqs, toks) for _ in ts], positions, picked,
                [positions[i] + 1 for i in picked],
                [r.slot for r, b in zip(drafting, budgets) for _ in range(b)], [1] * len(picked))]
            ends = itertools.accumulate(budgets)
            return [Proposal(flat[e - b:e]) for b, e in zip(budgets, ends)]
        out = self._run(reqs, toks, states, starts)                          # [n, H]
        picks = torch.tensor(picked, device=self.device)
        logits = self.head.logits(out[picks]).float()                        # [sum(budgets), V]
        return drafts_from_rows(logits, budgets, drafting, False, self.threshold)

    def _draft_trees(self, reqs, budgets: list[int], state: torch.Tensor) -> list[Proposal]:
        """Expand the token tree level by level: one head pass per level over every node that
        has children, each node attending to the verified context and its own ancestors."""
        trees = [self.tree.truncated(n) for n in budgets]
        parents = [t.parents for t in trees]
        ranks = [t.ranks for t in trees]
        depths = [node_depths(p) for p in parents]
        tokens = [[0] * len(t) for t in trees]
        outs: dict[tuple[int, int], torch.Tensor] = {(j, -1): state[j] for j in range(len(reqs))}

        def fill(nodes: list[tuple[int, int]], rows: torch.Tensor, depth: int) -> None:
            # tokens of the children of each (request, node) from that node's head output [N, H]
            kids = [[c for c, p in enumerate(parents[j]) if p == i] for j, i in nodes]
            need = 1 + max((ranks[j][c] for (j, _), ks in zip(nodes, kids) for c in ks),
                           default=0)
            tops = self.head.step_head(depth).top_tokens(rows, need).tolist()
            for (j, _), ks, top in zip(nodes, kids, tops):
                for c in ks:
                    tokens[j][c] = top[ranks[j][c]]

        fill([(j, -1) for j in range(len(reqs))], state, 0)
        for d in range(1, max(t.depth for t in trees)):
            nodes = [(j, i) for j in range(len(reqs)) for i in sorted(set(parents[j]) - {-1})
                     if depths[j][i] == d]
            if not nodes:
                break
            by_req = [[i for jj, i in nodes if jj == j] for j in range(len(reqs))]
            live = [j for j in range(len(reqs)) if by_req[j]]
            last = [reqs[j].num_tokens - 2 for j in live]     # the last ingested head position
            md = build_tree_metadata(
                [reqs[j].slot for j in live],
                [[p + 1 + i for i in by_req[j]] for j, p in zip(live, last)],
                [[p + 1] * len(by_req[j]) for j, p in zip(live, last)],
                [[[p + 1 + a for a in ancestors(parents[j], i)] for i in by_req[j]]
                 for j, p in zip(live, last)], self.device)
            order = [(j, i) for j in live for i in by_req[j]]
            ids = torch.tensor([tokens[j][i] for j, i in order], device=self.device)
            h = torch.stack([outs[(j, parents[j][i])] for j, i in order])       # [N, H]
            positions = torch.tensor([p + d for j, p in zip(live, last) for _ in by_req[j]],
                                     device=self.device)
            o = self.head.step_head(d)(ids, h, positions, md,
                                       self.cache.layers[d % self.num_layers])  # [N, H]
            outs.update({node: o[n] for n, node in enumerate(order)})
            fill(order, o, d)
        return [Proposal(toks, parents=None if t.is_chain else list(p))
                for toks, t, p in zip(tokens, trees, parents)]

    reuses_prefix = True

    def prefix_positions(self, request) -> int:
        return self.num_verified.get(request.request_id, 0)

    def resume_prefix(self, request, num_positions: int) -> None:
        self.num_verified[request.request_id] = self.num_seen[request.request_id] = num_positions

    def finish(self, request) -> None:
        self.num_verified.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)
        self.num_seen.pop(request.request_id, None)
