"""KV storage: one slot per running request, each slot holding up to `max_len` positions.

Writes go to explicit (slot, position) pairs, so a verify step appends k+1 tokens in place and
rejected drafts are rolled back by decreasing the request's `num_computed_tokens`: the next step
overwrites those positions. Nothing is ever copied to undo; only an accepted draft-tree branch
other than the first-child chain is moved into place (`move`).
"""

from __future__ import annotations

import math
import mmap

import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take memory only where written, on the CPU: an anonymous mapping, whose pages
    the system zeroes on first touch (torch.zeros writes every byte up front), in pages of 4 KiB
    where the system allows: NumPy's zeroed arrays ask for transparent huge pages, and then the
    first key of a request made 2 MiB of each layer's slot resident (a batch of short requests
    held every slot's whole context)."""
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, numel * dtype.itemsize)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)       # keeps buf alive


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 scratch_slot: bool = False) -> None:
        # scratch_slot: one more slot that is never allocated, where the padding rows of a
        # CUDA graph's batch write their KV
        self.scratch = num_slots if scratch_slot else None
        shape = (num_slots + scratch_slot, num_kv_heads, max_len, head_dim)
        # per layer: (keys, values), each [num_slots (+ scratch), num_kv_heads, max_len, head_dim]
        self.layers = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device))
                       for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        assert self._free, "no free KV slot; the scheduler must check num_free_slots"
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert slot not in self._free and 0 <= slot < self.num_slots
        self._free.append(slot)

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy the KV at positions `src` of a slot to positions `dst`, in every layer."""
        for k, v in self.layers:
            k[slot, :, dst] = k[slot, :, src]
            v[slot, :, dst] = v[slot, :, src]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)
