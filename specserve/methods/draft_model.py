"""A small LM with the target's tokenizer drafts K tokens: autoregressively, or all K in one
pass (PARD, `parallel_drafting`).

The draft keeps its own KV cache, allocated in lockstep with the target's (same slot per
request). Per request it remembers how many tokens its cache holds; drafts that the target
rejected are forgotten by lowering that count, exactly like the target's rollback. Each engine
step runs one ragged catch-up pass (the tokens the draft has not seen: the last accepted token
and the bonus/recovered one, or the whole prompt at first) and then K-1 one-token passes,
batched across requests; greedy, on the CPU kernel, all of them in one C call.

A PARD draft (trained with `specserve train pard`; its config.json names a mask token,
`pard_token`) appends K-1 mask tokens to the catch-up pass: the logits of the last real token
and of mask i give drafts 1 and i+1, so one pass drafts K tokens (greedy, on the CPU kernel,
in one C call with its picks). The masks' KV lies past the request's tokens, where the next
step's catch-up writes before anything reads it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specserve.config import SpeculativeConfig
from specserve.kernels.cpu import max_rows
from specserve.methods.base import DraftContext, MethodSpec, Proposal, ProposeBatch, ProposerBase
from specserve.methods.parallel import confident, drafts_from_rows, mask_token_id, pick_tokens
from specserve.models.layers import model_tensor
from specserve.models.loader import load_hf_config, load_model
from specserve.models.metadata import ragged_inputs
from specserve.sampling.sampler import greedy_ids

PARD_HINT = ("train one from this draft with `specserve train pard --draft DIR --target DIR "
             "--out DIR`, or leave parallel_drafting off")


@dataclass
class _DraftState:
    num_computed: int = 0          # tokens of the request whose KV the draft cache holds
    fed_drafts: list[int] | None = None   # drafts fed last step (beyond num_computed)


def _last_rows(lens: list[int], last: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Index of each request's last `last[i]` rows in a flat ragged batch of `lens` rows."""
    ends = itertools.accumulate(lens)
    return torch.tensor([i for e, n in zip(ends, last) for i in range(e - n, e)],
                        device=rows.device)


class DraftModelProposer(ProposerBase):
    def __init__(self, config: SpeculativeConfig, ctx: DraftContext) -> None:
        draft_cfg = load_hf_config(config.model)
        # past its context the engine decodes without drafts (the draft must see every token)
        self.max_model_len = limit = min(draft_cfg.get("max_position_embeddings", 2048),
                                         ctx.max_model_len)
        self.model = (ctx.load_sharded(config.model, limit) if ctx.load_sharded is not None
                      else ctx.backend.prepare(load_model(config.model, ctx.dtype, ctx.device,
                                                          max_len=limit)))
        if self.model.args.vocab_size != ctx.vocab_size:
            raise ValueError(
                f"draft model {config.model} has vocab_size {self.model.args.vocab_size} but the "
                f"target has {ctx.vocab_size}; a draft must share the target's vocabulary")
        a = self.model.args
        # the model's own dtype: bfloat16 weights that the CPU kernel runs keep float32 KV
        self.cache = ctx.new_kv_cache(a.num_hidden_layers,
                                      a.num_key_value_heads // self.model.tp_size, limit,
                                      a.head_dim, model_tensor(self.model).dtype)
        self.caches = [self.cache]
        self.modules = {"draft model": self.model}
        self.device = ctx.device
        self.sample = config.draft_sample_method == "probabilistic"
        self.threshold = config.draft_confidence_threshold
        self.mask_id = (mask_token_id(draft_cfg, config.model, PARD_HINT)
                        if config.parallel_drafting else None)
        if self.mask_id is not None and not 0 <= self.mask_id < ctx.vocab_size:
            raise ValueError(f"{config.model}: mask token {self.mask_id} is outside the "
                             f"vocabulary [0, {ctx.vocab_size})")
        self.state: dict[str, _DraftState] = {}
        # greedy drafting (the catch-up pass and the chain, or PARD's pass) in one compiled
        # call where the model has one (on the CPU kernel)
        self.chain = (ctx.backend.chain(self.model, self.cache.layers) if not self.sample
                      else None)
        self.graphs = ctx.backend.graphs(self.model, self.cache, ctx.num_slots)

    def _forward(self, reqs, token_lists: list[list[int]], starts: list[int],
                 last: list[int] | None = None) -> torch.Tensor:
        """Feed each request its tokens at `starts`; returns the logits of each one's last
        `last[i]` tokens (default 1), request-major: [sum(last), V]."""
        lens = [len(t) for t in token_lists]
        last = last or [1] * len(lens)
        if self.graphs is not None and self.graphs.fits(starts, lens):
            logits, _, _ = self.graphs.run([t for ts in token_lists for t in ts], starts, lens,
                                           [r.slot for r in reqs])                # [T, V]
            return logits if sum(last) == len(logits) else logits[_last_rows(lens, last,
                                                                             logits)]
        ids, positions, md = ragged_inputs(token_lists, starts, [r.slot for r in reqs],
                                           self.device)
        hidden = self.model(ids, positions, md, self.cache.layers)           # [T, H]
        return self.model.compute_logits(hidden[_last_rows(lens, last, hidden)]).float()

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[Proposal]:
        reqs, budgets = batch.requests, batch.max_num_tokens
        if not reqs:
            return []
        starts, feeds = [], []
        for r in reqs:
            st = self.state.setdefault(r.request_id, _DraftState())
            if st.fed_drafts:                   # keep KV of drafts the target accepted
                n = st.num_computed
                ok = 0
                # The last token is always fed again: its logits draft the next token. (A
                # token equal to a fed draft can also follow a rejection: synthetic
                # verification rejects without looking at the tokens.)
                while (ok < len(st.fed_drafts) and n + ok < r.num_tokens - 1
                       and r.all_token_ids[n + ok] == st.fed_drafts[ok]):
                    ok += 1
                st.num_computed = n + ok
            st.fed_drafts = None
            starts.append(st.num_computed)
            feeds.append(r.all_token_ids[st.num_computed:])
        if self.mask_id is not None:
            return self._propose_parallel(reqs, feeds, starts, budgets)
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        if self._in_one_call(feeds):
            ends = itertools.accumulate(len(f) for f in feeds)
            drafts = self._ingest(reqs, feeds, starts, [e - 1 for e in ends],
                                  [r.num_tokens for r in reqs], [r.slot for r in reqs], budgets)
            active = []
        else:
            logits = self._forward(reqs, feeds, starts)
        for r in reqs:
            self.state[r.request_id].num_computed = r.num_tokens
        if active and self.chain is not None and len(reqs) <= max_rows(self.chain.lib):
            first = greedy_ids(logits)
            if self.threshold:          # a first draft below it is the only one
                sure = confident(logits, first, self.threshold)
                budgets = [n if ok else 1 for n, ok in zip(budgets, sure)]
            drafts = self.chain(first, [r.num_tokens for r in reqs], [r.slot for r in reqs],
                                budgets, self.threshold)
            active = []
        while active:
            toks, ps = pick_tokens(logits, [reqs[i] for i in active], self.sample)
            for i, t, p in zip(active, toks, ps):
                drafts[i].append(t)
                probs[i].append(p)
            sure = (confident(logits, toks, self.threshold) if self.threshold
                    else [True] * len(active))
            active = [i for i, ok in zip(active, sure) if ok and len(drafts[i]) < budgets[i]]
            if not active:
                break
            sub = [reqs[i] for i in active]
            logits = self._forward(sub, [[drafts[i][-1]] for i in active],
                                   [reqs[i].num_tokens + len(drafts[i]) - 1 for i in active])
        out = []
        for i, r in enumerate(reqs):
            # Drafts 1..k-1 were fed to the draft model; their KV is kept if accepted.
            self.state[r.request_id].fed_drafts = drafts[i][:-1]
            p = torch.stack(probs[i]) if self.sample else None
            out.append(Proposal(drafts[i], p))
        return out

    def _in_one_call(self, token_lists: list[list[int]]) -> bool:
        """Whether a greedy pass over these rows (and the chain after it) runs in one C call:
        on the kernel, within its row limit."""
        return (self.chain is not None
                and sum(len(t) for t in token_lists) <= max_rows(self.chain.lib))

    def _ingest(self, reqs, token_lists: list[list[int]], starts: list[int], last: list[int],
                positions: list[int], slots: list[int], budgets: list[int]) -> list[list[int]]:
        """The C call: each request's tokens fed from its start, then greedy chains of
        budgets[b] drafts from pass rows last[b], fed on at positions[b] of slots[b]."""
        return self.chain.after_ingest(
            [t for ts in token_lists for t in ts],
            [r.slot for r, ts in zip(reqs, token_lists) for _ in ts],
            [s + i for s, ts in zip(starts, token_lists) for i in range(len(ts))],
            last, positions, slots, budgets, self.threshold)

    def _propose_parallel(self, reqs, feeds: list[list[int]], starts: list[int],
                          budgets: list[int]) -> list[Proposal]:
        """PARD: one pass over each request's new tokens and budget-1 masks drafts them all."""
        masked = [f + [self.mask_id] * (n - 1) for f, n in zip(feeds, budgets)]
        for r in reqs:
            self.state[r.request_id].num_computed = r.num_tokens     # the masks' KV is not kept
        if not self.threshold and self._in_one_call(masked):
            # each drafting row (the last real token's, the masks') is a chain of one draft
            ends = list(itertools.accumulate(len(m) for m in masked))
            picked = [e - n + j for e, n in zip(ends, budgets) for j in range(n)]
            past = [s + len(m) for s, m, n in zip(starts, masked, budgets) for _ in range(n)]
            flat = [d for (d,) in self._ingest(      # `past`: where a chain would feed, unused
                reqs, masked, starts, picked, past,
                [r.slot for r, n in zip(reqs, budgets) for _ in range(n)], [1] * len(picked))]
            return [Proposal(flat[e - n:e]) for n, e in zip(budgets,
                                                            itertools.accumulate(budgets))]
        logits = self._forward(reqs, masked, starts, budgets)          # [sum(budgets), V]
        return drafts_from_rows(logits, budgets, reqs, self.sample, self.threshold)

    reuses_prefix = True

    def prefix_positions(self, request) -> int:
        st = self.state.get(request.request_id)
        return st.num_computed if st is not None else 0

    def resume_prefix(self, request, num_positions: int) -> None:
        self.state[request.request_id] = _DraftState(num_computed=num_positions)

    def finish(self, request) -> None:
        self.state.pop(request.request_id, None)


SPEC = MethodSpec(name="draft_model", build=DraftModelProposer, needs_model=True,
                  steps_drafts=True, samples_drafts=True, drafts_in_parallel=True,
                  shards=True,
                  summary="a small LM with the target's vocabulary")
