"""Attention metadata for a flat ragged batch: where each token's KV goes and what it sees.

Used by the target's runner and by every drafter that runs a model with a KV cache.
"""

from __future__ import annotations

import torch

from specserve.models.layers import AttentionMetadata
from specserve.token_tree import ancestors, node_depths


def build_metadata(starts: list[int], lens: list[int], slots: list[int],
                   device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Attention metadata for requests whose new tokens start at `starts` with `lens` tokens.

    Returns the metadata and the flat positions [num_tokens].
    """
    B, Q = len(lens), max(lens)
    positions = torch.tensor([s + j for s, n in zip(starts, lens) for j in range(n)],
                             dtype=torch.long, device=device)
    max_kv = max(s + n for s, n in zip(starts, lens))
    md = _metadata(slots, lens, positions, max_kv, None, device)
    if not (B == 1 and Q == 1):
        md.starts = list(starts)            # the causal mask, built only if a layer needs it
    return md, positions


def build_tree_metadata(slots: list[int], store: list[list[int]], ctx: list[list[int]],
                        extra: list[list[list[int]]], device: torch.device) -> AttentionMetadata:
    """Metadata for rows that are not one causal run (draft tree nodes): row j of request b
    writes its KV at position store[b][j] and attends to the positions < ctx[b][j] plus the
    positions extra[b][j] (a node's ancestors and itself). Its rotary position is the caller's."""
    lens = [len(s) for s in store]
    Q = max(lens)
    max_kv = max(max(max(s) + 1, max(c)) for s, c in zip(store, ctx))
    # padding rows see position 0: never all -inf
    ctx_t = torch.tensor([c + [1] * (Q - len(c)) for c in ctx], dtype=torch.long)      # [B, Q]
    mask = torch.arange(max_kv)[None, None, :] < ctx_t[:, :, None]              # [B, Q, L]
    idx = [(b, j, col) for b, rows in enumerate(extra) for j, cols in enumerate(rows)
           for col in cols]
    if idx:
        bi, qi, ci = zip(*idx)
        mask[list(bi), list(qi), list(ci)] = True
    positions = torch.tensor([p for s in store for p in s], dtype=torch.long, device=device)
    md = _metadata(slots, lens, positions, max_kv, mask.unsqueeze(1).to(device), device)
    md.tree = True
    return md


def _metadata(slots: list[int], lens: list[int], positions: torch.Tensor, max_kv: int,
              mask: torch.Tensor | None, device: torch.device) -> AttentionMetadata:
    B, Q = len(lens), max(lens)
    token_slots = torch.tensor([sl for sl, n in zip(slots, lens) for _ in range(n)],
                               dtype=torch.long, device=device)
    pad_index = None
    if any(n != Q for n in lens):
        pad_index = torch.tensor([b * Q + j for b, n in enumerate(lens) for j in range(n)],
                                 dtype=torch.long, device=device)
    return AttentionMetadata(
        token_slots=token_slots, positions=positions,
        slot_ids=torch.tensor(slots, dtype=torch.long, device=device), first_slot=slots[0],
        batch_size=B, max_query_len=Q, max_kv_len=max_kv, pad_index=pad_index, mask=mask)


def tree_rows(start: int, n_known: int, parents: list[int] | None, k: int
              ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """(KV positions, rotary positions, ctx, extra) of a request feeding n_known tokens from
    `start` and then k drafts with tree `parents` (None: a chain), for build_tree_metadata.
    Draft i is stored at start + n_known + i but rotated at its depth in the tree."""
    store = list(range(start, start + n_known + k))
    if parents is None:
        return store, store, [p + 1 for p in store], [[] for _ in store]
    last = start + n_known - 1
    rope = store[:n_known] + [last + d for d in node_depths(parents)]
    ctx = [p + 1 for p in store[:n_known]] + [last + 1] * k
    extra = [[] for _ in range(n_known)] + [[last + 1 + a for a in ancestors(parents, i)]
                                            for i in range(k)]
    return store, rope, ctx, extra


def ragged_inputs(token_lists: list[list[int]], starts: list[int], slots: list[int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat token ids [T], positions [T] and attention metadata for requests feeding
    `token_lists[i]` from position `starts[i]` into KV slot `slots[i]`."""
    md, positions = build_metadata(starts, [len(t) for t in token_lists], slots, device)
    ids = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=device)
    return ids, positions, md


def step_inputs(step: dict, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids [T], rotary positions [T] and attention metadata of a step described by plain
    lists (`ids`, `starts`, `lens`, `slots`, and `tree`: per request (store, rope, ctx, extra)
    of `tree_rows`, or None): what the runner and tensor-parallel workers both build."""
    if step["tree"] is not None:
        rows = step["tree"]
        md = build_tree_metadata(step["slots"], [r[0] for r in rows], [r[2] for r in rows],
                                 [r[3] for r in rows], device)
        positions = torch.tensor([p for r in rows for p in r[1]], dtype=torch.long,
                                 device=device)
    else:
        md, positions = build_metadata(step["starts"], step["lens"], step["slots"], device)
    return torch.tensor(step["ids"], dtype=torch.long, device=device), positions, md


def metadata_dict(md: AttentionMetadata) -> dict:
    """`md` as plain lists (a causal step's mask is left to be rebuilt from its starts), for
    `metadata_from_dict` in another process."""
    lists = {k: None if t is None else t.tolist()
             for k, t in (("token_slots", md.token_slots), ("positions", md.positions),
                          ("slot_ids", md.slot_ids), ("pad_index", md.pad_index),
                          ("mask", None if md.starts is not None else md.mask))}
    return lists | {"first_slot": md.first_slot, "batch_size": md.batch_size,
                    "max_query_len": md.max_query_len, "max_kv_len": md.max_kv_len,
                    "tree": md.tree, "starts": md.starts}


def metadata_from_dict(d: dict, device: torch.device) -> AttentionMetadata:
    def tensor(k: str, dtype: torch.dtype) -> torch.Tensor | None:
        return None if d[k] is None else torch.tensor(d[k], dtype=dtype, device=device)

    return AttentionMetadata(
        token_slots=tensor("token_slots", torch.long), positions=tensor("positions", torch.long),
        slot_ids=tensor("slot_ids", torch.long), first_slot=d["first_slot"],
        batch_size=d["batch_size"], max_query_len=d["max_query_len"],
        max_kv_len=d["max_kv_len"], pad_index=tensor("pad_index", torch.long),
        mask=tensor("mask", torch.bool), tree=d["tree"], starts=d["starts"])
