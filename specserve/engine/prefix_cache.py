"""Automatic prefix caching: the KV of prompt prefixes seen before, reused by content.

Verified tokens' KV is kept in blocks of `block_size` tokens in a pool beside the slots, keyed
by a chain over token blocks: a block's key is (its parent block's id, its tokens), so a block
matches only where every token before it matched too (a dict compares the tuples: no hash
collision can make two texts share a block). A new request's longest run of matching blocks is
copied into its slot, for the target's cache and every drafter cache alike, and its prefill
starts after them. Copying (rather than block tables in the kernel's attention) keeps every
attention path and cache layout as it is; its cost is a memory copy of the prefix's KV (70 MB
for 1,500 tokens of SmolLM2 in float32: about 20 ms on 2 cores, against 5 s of prefill;
`specserve bench prefix` measures it).

Only verified positions are ever stored: the target's KV below a request's computed count, a
drafter's below what its proposer reports (`prefix_positions`), never drafts or rejected rows.
The last matched token is recomputed: its target pass gives the hidden state a head needs to
ingest the pair (state, next token), which the cached blocks cannot hold for a token that
follows them. Blocks are evicted least recently used first, tail blocks before the blocks
they extend (a chain is touched from its end back to its start).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from specserve.kv_cache import KVCache

# vLLM's default block size: small enough that most of a shared prefix is whole blocks
PREFIX_BLOCK_SIZE = 16

_Key = tuple[int, tuple[int, ...]]          # (parent block's id, the block's tokens)


class PrefixCache:
    def __init__(self, caches: list[KVCache], block_size: int, max_tokens: int) -> None:
        self.caches = caches
        self.block_size = block_size
        self.num_blocks = max(1, max_tokens // block_size)
        # blocks a slot can hold in every cache (a draft model's context may be shorter)
        self.max_blocks = min(c.max_len for c in caches) // block_size
        # per cache, per layer: (keys, values), each [num_blocks, kv_heads, block_size, head_dim];
        # empty, not zeroed: a block is written before it is read, and memory never written
        # stays unallocated (the whole pool is hundreds of MB for a real model)
        self.pools = [[tuple(torch.empty((self.num_blocks, *k.shape[1:2], block_size,
                                          k.shape[-1]), dtype=k.dtype, device=k.device)
                             for _ in range(2)) for k, _ in c.layers] for c in caches]
        self.blocks: OrderedDict[_Key, tuple[int, int]] = OrderedDict()  # -> (id, pool index)
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self._ids = itertools.count()
        self.queries = 0            # prompt tokens looked up
        self.hits = 0               # of which reused

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.pools for kv in p for t in kv)

    def _chain(self, tokens: list[int], num_blocks: int):
        """(key, entry or None) of the first `num_blocks` blocks of `tokens`, stopping at the
        first block that is not cached (its entry None) and after it."""
        parent, bs = -1, self.block_size
        for b in range(num_blocks):
            key = (parent, tuple(tokens[b * bs:(b + 1) * bs]))
            entry = self.blocks.get(key)
            yield key, entry
            if entry is None:
                return
            parent = entry[0]

    def _touch(self, keys: list[_Key]) -> None:
        for key in reversed(keys):          # the chain's start most recent: evicted last
            self.blocks.move_to_end(key)

    def lookup(self, prompt: list[int], slot: int) -> int:
        """Copy the longest cached prefix of `prompt` into `slot` of every cache; returns the
        positions now holding it (whole blocks but the last token, which the prefill
        recomputes), 0 for none. Only blocks inside the prompt match: at least one prompt
        token is always computed."""
        self.queries += len(prompt)
        found = [(key, entry) for key, entry in
                 self._chain(prompt, min(len(prompt) // self.block_size, self.max_blocks))
                 if entry is not None]
        if not found:
            return 0
        self._touch([key for key, _ in found])
        self._copy([entry[1] for _, entry in found], slot, 0, into_slot=True)
        n = len(found) * self.block_size - 1
        self.hits += n
        return n

    def insert(self, tokens: list[int], num_valid: int, slot: int) -> None:
        """Store the whole blocks of `tokens` whose positions (< `num_valid`) hold verified KV
        in `slot` of every cache and are not cached yet."""
        n = min(num_valid // self.block_size, self.max_blocks, self.num_blocks)
        keys, parent = [], -1
        for key, entry in self._chain(tokens, n):
            if entry is None:
                break
            keys.append(key)
            parent = entry[0]
        self._touch(keys)                   # not evicted for the blocks taken below
        first, new = len(keys), []
        for b in range(first, n):           # after an uncached block every block is new
            key = (parent, tuple(tokens[b * self.block_size:(b + 1) * self.block_size]))
            entry = self.blocks[key] = (next(self._ids), self._take())
            keys.append(key)
            new.append(entry[1])
            parent = entry[0]
        if new:
            self._copy(new, slot, first, into_slot=False)
        self._touch(keys)

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        _, (_, idx) = self.blocks.popitem(last=False)       # least recently used
        return idx

    def _copy(self, pool_idx: list[int], slot: int, first: int, into_slot: bool) -> None:
        """Pool blocks `pool_idx` <-> the slot's blocks first, first + 1, ..., every cache."""
        bs, n = self.block_size, len(pool_idx)
        idx = torch.tensor(pool_idx, device=self.pools[0][0][0].device)
        for cache, pool in zip(self.caches, self.pools):
            for layer, pool_layer in zip(cache.layers, pool):
                for c, p in zip(layer, pool_layer):
                    part = c[slot, :, first * bs:(first + n) * bs]          # [H, n * bs, D]
                    H, D = part.shape[0], part.shape[-1]
                    # index_select / index_copy_: advanced indexing (p[idx]) costs
                    # milliseconds per call on the CPU where these take microseconds
                    if into_slot:
                        part.copy_(p.index_select(0, idx).transpose(0, 1).reshape(H, n * bs, D))
                    else:
                        p.index_copy_(0, idx, part.reshape(H, n, bs, D).transpose(0, 1))

    def reset(self) -> None:
        """Forget every cached block (a benchmark repeating its prompts)."""
        self.blocks.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0}
