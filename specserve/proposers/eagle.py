"""EAGLE, EAGLE-3 and MTP: a one-layer head with its own KV cache, driven by target features.

Head position p holds the pair (state at p, token at p+1). Every step the head ingests, for
every request the target just ran (prompt chunks included), the pairs of the positions the
target has verified since: (target hidden at p, token p+1). Its output at the last verified
position drafts the first token; each further draft feeds (head output, last draft) at the next
position. Positions written while drafting are overwritten by the next step's target pairs, so
rollback is just the count of verified positions, as for the target.

While no request drafts (K = 0 by `disable_by_batch_size` or `adaptive_k`), ingestion waits:
the target features of each step are kept per request and fed in one pass when drafting
resumes, or once a request has `MAX_PENDING` of them (bounding the memory they hold).
"""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.engine.runner import ragged_inputs
from specserve.kv_cache import KVCache
from specserve.models.head_loader import load_head
from specserve.models.layers import Rotary
from specserve.proposers.base import Proposal, ProposeBatch


class HeadProposer:
    # Positions of target features a request may hold back (256 x 3 x 384 float32 = 1.2 MB for
    # the bundled EAGLE-3, a tenth of its target's KV slot). Features of a request that ends
    # before drafting resumes are never ingested, so a larger bound saves more work under load.
    MAX_PENDING = 256

    def __init__(self, config: SpeculativeConfig, engine) -> None:
        self.method = config.method
        self.head = load_head(config.method, config.model or engine.config.model_config.model,
                              engine.model, engine.device, engine.dtype)
        a = self.head.args
        max_len = engine.max_model_len + config.num_speculative_tokens + 1
        self.head.rotary = Rotary(a.head_dim, max_len, a.rope_theta, a.rope_scaling).to(
            engine.device)
        self.cache = KVCache(1, engine.cache.num_slots, a.num_key_value_heads, max_len,
                             a.head_dim, engine.dtype, engine.device)
        self.caches = [self.cache]
        self.device = engine.device
        self.threshold = config.draft_confidence_threshold
        self.aux_hidden_layers = tuple(getattr(self.head, "aux_layers", ()))
        self.num_verified: dict[str, int] = {}      # head positions holding target pairs
        # request id -> target feature rows [n, F] for the positions after num_verified
        self.pending: dict[str, list[torch.Tensor]] = {}
        self.num_seen: dict[str, int] = {}          # num_verified + pending rows

    def _run(self, reqs, token_lists, h: torch.Tensor, starts: list[int]) -> torch.Tensor:
        ids, positions, md = ragged_inputs(token_lists, starts, [r.slot for r in reqs],
                                           self.device)
        return self.head(ids, h, positions, md, self.cache.layers[0])        # [T, H]

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
        head_out = self._run(reqs, tokens, h, starts)
        ends = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        last = {id(r): head_out[e] for r, e in zip(reqs, ends.tolist())}
        drafting = batch.requests
        if not drafting:
            return []
        state = torch.stack([last[id(r)] for r in drafting])               # [B, H]
        drafts: list[list[int]] = [[] for _ in drafting]
        active = list(range(len(drafting)))
        while True:
            if self.threshold:
                toks, conf = self.head.greedy_tokens_with_prob(state)
                sure = (conf >= self.threshold).tolist()
            else:
                toks, sure = self.head.greedy_tokens(state), [True] * len(active)
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
                              [r.num_tokens - 2 + len(drafts[j]) for r, j in zip(sub, active)])
        return [Proposal(d) for d in drafts]

    def finish(self, request) -> None:
        self.num_verified.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)
        self.num_seen.pop(request.request_id, None)
