"""Batch -> tensors -> one target forward -> logits at the rows that are sampled.

All scheduled tokens form one flat ragged batch (request-major). For each request the runner
feeds the tokens it lacks KV for followed by its drafts, so a verify step is `[last, d1..dk]`.
Drafts that form a tree (`Request.spec_parents`) are stored in that order too, but rotated at
their depth and masked to see only their ancestors (`tree_rows`, `build_tree_metadata`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledRequest
from specserve.kv_cache import KVCache
from specserve.methods import RunnerOutput
from specserve.models.cuda_graphs import CudaGraphs
from specserve.models.metadata import step_inputs, tree_rows
from specserve.sampling.penalties import needs_processing


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device,
                 graphs: CudaGraphs | None = None,
                 before_step: Callable[[dict], None] | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs = graphs                      # few-row steps replayed on CUDA
        # the executor's: the other ranks run each step's shards
        self.before_step = before_step
        self.aux_layers: tuple[int, ...] = ()     # set by the engine for EAGLE-3 proposers

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> RunnerOutput:
        ids: list[int] = []
        starts, lens, slots, sample_rows = [], [], [], []
        cu = [0]
        for item in batch:
            r = item.request
            n_known = item.num_new_tokens - item.num_spec_tokens
            start = r.num_computed_tokens
            ids.extend(r.all_token_ids[start:start + n_known])
            ids.extend(r.spec_token_ids[:item.num_spec_tokens])
            starts.append(start)
            lens.append(item.num_new_tokens)
            slots.append(r.slot)
            cu.append(cu[-1] + item.num_new_tokens)
            sample_rows.extend(range(cu[-1] - item.num_sample_rows, cu[-1]))
        tree = any(b.num_spec_tokens and b.request.spec_parents is not None for b in batch)
        if not tree and self.graphs is not None and self.graphs.fits(starts, lens):
            logits, hidden, aux = self.graphs.run(ids, starts, lens, slots, self.aux_layers)
            if len(sample_rows) != len(ids):
                logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
            return RunnerOutput(logits, hidden, aux, cu, starts)
        step = {"ids": ids, "starts": starts, "lens": lens, "slots": slots, "tree": [
            tree_rows(s, b.num_new_tokens - b.num_spec_tokens,
                      b.request.spec_parents if b.num_spec_tokens else None, b.num_spec_tokens)
            for s, b in zip(starts, batch)] if tree else None}
        token_ids, positions, md = step_inputs(step, self.device)
        aux = None
        if self.before_step is not None:
            self.before_step(step)
        if self.aux_layers:
            hidden, aux = self.model(token_ids, positions, md, self.cache.layers,
                                     aux_layers=self.aux_layers)            # [T, H], [T, n*H]
        else:
            hidden = self.model(token_ids, positions, md, self.cache.layers)      # [T, H]
        if len(sample_rows) == len(ids):
            rows = hidden
        else:
            rows = hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        if all(argmax_only(b.request) for b in batch) and hasattr(self.model, "greedy_logits"):
            logits = self.model.greedy_logits(rows).float()                  # [N, V]
        else:
            logits = self.model.compute_logits(rows).float()                 # [N, V]
        return RunnerOutput(logits, hidden, aux, cu, starts)


def argmax_only(r: Request) -> bool:
    """Whether a request's next tokens come from its logits' argmax alone: greedy, no
    logprobs, nothing (penalties, biases, a grammar) changing the logits first."""
    return (r.params.is_greedy and r.logprobs is None and r.grammar is None
            and not needs_processing(r.params))
