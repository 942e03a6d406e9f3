"""Batch -> tensors -> one target forward -> logits at the rows that are sampled.

All scheduled tokens form one flat ragged batch (request-major). For each request the runner
feeds the tokens it lacks KV for followed by its drafts, so a verify step is `[last, d1..dk]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.scheduler import ScheduledRequest
from specserve.kv_cache import KVCache
from specserve.models.layers import AttentionMetadata


@dataclass(slots=True)
class RunnerOutput:
    logits: torch.Tensor            # [num_sample_rows, vocab] float32, request-major
    hidden: torch.Tensor            # [num_tokens, hidden] final hidden states of all fed tokens
    aux_hidden: torch.Tensor | None  # [num_tokens, len(aux_layers) * hidden] or None
    cu_num_tokens: list[int]        # [batch + 1] offsets of each request's tokens in the flat batch
    starts: list[int]               # [batch] position of each request's first fed token

    def rows(self, i: int, num_valid_end: int) -> tuple[int, int]:
        """Flat rows of request i whose KV is kept: positions starts[i]..num_valid_end-1."""
        return self.cu_num_tokens[i], self.cu_num_tokens[i] + num_valid_end - self.starts[i]


def build_metadata(starts: list[int], lens: list[int], slots: list[int],
                   device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Attention metadata for requests whose new tokens start at `starts` with `lens` tokens.

    Returns the metadata and the flat positions [num_tokens].
    """
    B, Q = len(lens), max(lens)
    positions = torch.tensor([s + j for s, n in zip(starts, lens) for j in range(n)],
                             dtype=torch.long, device=device)
    token_slots = torch.tensor([sl for sl, n in zip(slots, lens) for _ in range(n)],
                               dtype=torch.long, device=device)
    max_kv = max(s + n for s, n in zip(starts, lens))
    pad_index = None
    if any(n != Q for n in lens):
        pad_index = torch.tensor([b * Q + j for b, n in enumerate(lens) for j in range(n)],
                                 dtype=torch.long, device=device)
    mask = None
    if not (B == 1 and Q == 1):
        qpos = (torch.tensor(starts, device=device)[:, None]
                + torch.arange(Q, device=device)[None, :])                      # [B, Q]
        mask = (torch.arange(max_kv, device=device)[None, None, :]
                <= qpos[:, :, None]).unsqueeze(1)                               # [B, 1, Q, L]
    md = AttentionMetadata(
        token_slots=token_slots, positions=positions,
        slot_ids=torch.tensor(slots, dtype=torch.long, device=device), first_slot=slots[0],
        batch_size=B, max_query_len=Q, max_kv_len=max_kv, pad_index=pad_index, mask=mask)
    return md, positions


def ragged_inputs(token_lists: list[list[int]], starts: list[int], slots: list[int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat token ids [T], positions [T] and attention metadata for requests feeding
    `token_lists[i]` from position `starts[i]` into KV slot `slots[i]`."""
    md, positions = build_metadata(starts, [len(t) for t in token_lists], slots, device)
    ids = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=device)
    return ids, positions, md


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device
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
        md, positions = build_metadata(starts, lens, slots, self.device)
        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        aux = None
        if self.aux_layers:
            hidden, aux = self.model(token_ids, positions, md, self.cache.layers,
                                     aux_layers=self.aux_layers)            # [T, H], [T, n*H]
        else:
            hidden = self.model(token_ids, positions, md, self.cache.layers)  # [T, H]
        if len(sample_rows) == len(ids):
            rows = hidden
        else:
            rows = hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(rows).float()                     # [N, V]
        return RunnerOutput(logits, hidden, aux, cu, starts)
