"""Continuous batching under a per-step token budget.

There is no prefill or decode phase: each step every scheduled request gets the tokens it still
lacks KV for (`num_tokens - num_computed_tokens`, plus its pending drafts), clipped to the
budget. Long prompts are therefore prefilled in chunks, and a decode step with k drafts is simply
a request with 1 + k new tokens. Running requests go first; waiting ones join when a KV slot and
budget are free, and requests leave as soon as they finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specserve.config import SchedulerConfig
from specserve.engine.request import Request, RequestStatus
from specserve.kv_cache import KVCache


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int          # tokens fed to the model this step
    num_spec_tokens: int         # of which trailing drafts to verify (0 = none)
    num_sample_rows: int         # logits rows to sample from: 0 (partial prefill) or 1 + drafts


class Scheduler:
    def __init__(self, config: SchedulerConfig, caches: list[KVCache],
                 on_admit: Callable[[Request], None] | None = None) -> None:
        self.config = config
        self.caches = caches          # the target's cache, plus a draft model's if any
        # called with each request given its slot, before its tokens are counted (prefix
        # caching sets num_computed_tokens there)
        self.on_admit = on_admit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        # Every running request first gets the tokens it lacks KV for (1 when decoding, a chunk
        # when prefilling), then waiting requests are admitted, and only the budget left over
        # goes to drafts - so drafts never crowd a request out of a step.
        budget = self.config.max_num_batched_tokens
        plans: list[tuple[Request, int]] = []
        for req in self.running:
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            plans.append((req, n))
            budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self.caches[0].num_free_slots > 0):
            req = self.waiting.popleft()
            req.slot = self.caches[0].allocate()
            for c in self.caches[1:]:
                assert c.allocate() == req.slot, "draft and target caches allocate in lockstep"
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if self.on_admit is not None:
                self.on_admit(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            plans.append((req, n))
            budget -= n
        out = []
        for req, n in plans:
            complete = n == req.num_tokens - req.num_computed_tokens   # all known tokens fed
            k = min(len(req.spec_token_ids), budget) if complete else 0
            budget -= k
            if k < len(req.spec_token_ids):
                req.spec_token_ids = req.spec_token_ids[:k]
                if req.spec_token_probs is not None:
                    req.spec_token_probs = req.spec_token_probs[:k]
                if req.spec_parents is not None:        # the first k nodes are still a tree
                    req.spec_parents = req.spec_parents[:k]
            out.append(ScheduledRequest(req, n + k, k, 1 + k if complete else 0))
        return out

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and free its KV slot."""
        if req in self.running:
            self.running.remove(req)
            for c in self.caches:
                c.free(req.slot)
            req.slot = None
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
