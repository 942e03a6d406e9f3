"""CUDA graphs of a model's few-row cached steps.

A small model's decode step on a GPU costs the launches of its ~20 kernels per layer, not their
work. Steps in which every request feeds at most `max_query_len` tokens (decode: 1, verify: up
to K+1, a draft model's chain: 1) are replayed from graphs captured once per shape: each request
padded to the step's longest Q, the batch to a bucket (1, 2, 4, 8, ...), the attended context
to a power of two. Padding rows write their KV into the cache's scratch slot and are dropped
from the outputs. Other steps (long prompt chunks, draft trees) run eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.kv_cache import KVCache
from specserve.models.layers import AttentionMetadata, model_tensor


def _buckets(limit: int, first: int) -> list[int]:
    out = [first]
    while out[-1] < limit:
        out.append(min(2 * out[-1], limit))
    return out


def _capture(fn, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """`fn` run once on a side stream (its lazy initialisations), then captured; returns the
    graph and the outputs its replays overwrite."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


class CudaGraphs:
    """Replays `model`'s cached forward (ids, positions, metadata, KV layers) from CUDA graphs
    for steps of up to `max_batch` requests of up to `max_query_len` tokens each."""

    def __init__(self, model: nn.Module, cache: KVCache, max_batch: int,
                 max_query_len: int = 16) -> None:
        assert cache.scratch is not None, "CUDA graphs pad batches into the cache's scratch slot"
        self.model, self.cache = model, cache
        self.max_query_len = max_query_len
        self.batch_buckets = _buckets(max_batch, 1)
        self.len_buckets = _buckets(cache.max_len, min(256, cache.max_len))
        self.device = cache.layers[0][0].device
        self.pool = torch.cuda.graph_pool_handle()
        # what the graphs read must outlive them: the key positions, and the inputs below
        self.span = torch.arange(cache.max_len, device=self.device)
        # (batch bucket, Q, context bucket, aux layers) -> (graph, inputs, outputs)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]] = {}

    def fits(self, starts: list[int], lens: list[int]) -> bool:
        return (len(lens) <= self.batch_buckets[-1] and max(lens) <= self.max_query_len
                and max(starts) + max(lens) <= self.cache.max_len)

    @torch.inference_mode()
    def run(self, ids: list[int], starts: list[int], lens: list[int], slots: list[int],
            aux_layers: tuple[int, ...] = ()
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Feed request i its lens[i] tokens (request-major in `ids`) from position starts[i]
        into KV slot slots[i]. Returns, for the T = sum(lens) rows: logits [T, V] (float32),
        final hidden states [T, H] and the aux layers' inputs [T, n*H] (or None), all fresh."""
        B, q, scratch = len(slots), max(lens), self.cache.scratch
        bb = next(b for b in self.batch_buckets if b >= B)
        lb = next(n for n in self.len_buckets if n >= max(starts) + q)
        key = (bb, q, lb, aux_layers)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bb, q, lb, aux_layers)
        graph, inputs, outputs = self.graphs[key]
        tokens, positions, token_slots, rows = [], [], [], []
        for b, (s, n, slot) in enumerate(zip(starts, lens, slots)):
            tokens += ids[len(rows):len(rows) + n] + [0] * (q - n)
            positions += range(s, s + q)
            token_slots += [slot] * n + [scratch] * (q - n)
            rows += range(b * q, b * q + n)
        pad = (bb - B) * q
        inputs.copy_(torch.tensor(tokens + [0] * pad + positions + [0] * pad + token_slots
                                  + [scratch] * pad + slots + [scratch] * (bb - B),
                                  dtype=torch.long))
        graph.replay()
        if len(rows) == B * q:
            return tuple(None if t is None else t[:len(rows)].clone() for t in outputs)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return tuple(None if t is None else t[index] for t in outputs)

    def _capture(self, bb: int, q: int, lb: int, aux_layers: tuple[int, ...]):
        n = bb * q
        inputs = torch.zeros(3 * n + bb, dtype=torch.long, device=self.device)
        inputs[2 * n:].fill_(self.cache.scratch)        # warm-up runs write the scratch slot
        ids, positions, token_slots, slot_ids = inputs.split([n, n, n, bb])
        span = self.span[:lb]

        def step():
            mask = (span[None, None, :] <= positions.view(bb, q)[:, :, None]).unsqueeze(1)
            md = AttentionMetadata(token_slots=token_slots, positions=positions,
                                   slot_ids=slot_ids, first_slot=None, batch_size=bb,
                                   max_query_len=q, max_kv_len=lb, pad_index=None, mask=mask)
            out = self.model(ids, positions, md, self.cache.layers, aux_layers=aux_layers)
            hidden, aux = out if aux_layers else (out, None)
            return self.model.compute_logits(hidden).float(), hidden, aux

        graph, outputs = _capture(step, self.device, self.pool)
        return graph, inputs, outputs


class HeadChainGraphs:
    """Greedy draft chains of a stateful head (EAGLE, EAGLE-3, MTP) replayed from CUDA graphs:
    the K greedy picks and the K-1 head steps between them in one replay per (batch bucket, K,
    context bucket), the drafts staying on the device until the chain ends. Eagerly the chain
    costs ~25 kernel launches and a host sync per draft, more than a large target's verify
    step saves. Padding rows write their KV into the scratch slot. `capture=False` runs the
    same padded function eagerly (what the CPU tests check)."""

    def __init__(self, head: nn.Module, cache: KVCache, max_batch: int,
                 capture: bool = True) -> None:
        assert cache.scratch is not None, "padding rows need the cache's scratch slot"
        self.head, self.cache, self.capture = head, cache, capture
        self.num_layers = head.num_step_layers
        self.batch_buckets = _buckets(max_batch, 1)
        self.len_buckets = _buckets(cache.max_len, min(256, cache.max_len))
        self.device = cache.layers[0][0].device
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.span = torch.arange(cache.max_len, device=self.device)
        # (batch bucket, K, context bucket) -> (run, state input, index input, drafts output)
        self.graphs: dict[tuple[int, int, int], tuple] = {}

    def fits(self, batch: int, last_position: int) -> bool:
        return batch <= self.batch_buckets[-1] and last_position < self.cache.max_len

    @torch.inference_mode()
    def run(self, state: torch.Tensor, bases: list[int], slots: list[int], k: int
            ) -> list[list[int]]:
        """k greedy drafts for each of B requests from the head's outputs state [B, H] at
        their last verified positions; request i's j-th head step (j >= 1) writes position
        bases[i] + j of slot slots[i]. Returns the drafts (target ids), B lists of k."""
        B, scratch = len(slots), self.cache.scratch
        bb = next(b for b in self.batch_buckets if b >= B)
        lb = next(n for n in self.len_buckets if n > max(bases) + k - 1)
        key = (bb, k, lb)
        if key not in self.graphs:
            self.graphs[key] = self._build(bb, k, lb)
        step, state_in, index, drafts = self.graphs[key]
        state_in[:B].copy_(state)
        index.copy_(torch.tensor(bases + [0] * (bb - B) + slots + [scratch] * (bb - B),
                                 dtype=torch.long))
        out = step()
        return (drafts if out is None else out)[:B].tolist()

    def _build(self, bb: int, k: int, lb: int):
        state_in = torch.zeros(bb, self.head.args.hidden_size, device=self.device,
                               dtype=model_tensor(self.head).dtype)
        index = torch.zeros(2 * bb, dtype=torch.long, device=self.device)
        index[bb:].fill_(self.cache.scratch)            # warm-up runs write the scratch slot
        bases, slots = index.split([bb, bb])
        span = self.span[:lb]

        def chain() -> torch.Tensor:
            state, tok = state_in, self.head.step_head(0).greedy_tokens(state_in)     # [bb]
            toks = [tok]
            for j in range(1, k):
                head, pos = self.head.step_head(j), bases + j                       # [bb]
                mask = (span[None, None, :] <= pos[:, None, None]).unsqueeze(1)  # [bb,1,1,lb]
                md = AttentionMetadata(token_slots=slots, positions=pos, slot_ids=slots,
                                       first_slot=None, batch_size=bb, max_query_len=1,
                                       max_kv_len=lb, pad_index=None, mask=mask)
                state = head(tok, state, pos, md, self.cache.layers[j % self.num_layers])
                tok = head.greedy_tokens(state)
                toks.append(tok)
            return torch.stack(toks, 1)                                             # [bb, k]

        if not self.capture:
            return chain, state_in, index, None
        graph, drafts = _capture(chain, self.device, self.pool)
        return graph.replay, state_in, index, drafts     # replay() returns None: read drafts
