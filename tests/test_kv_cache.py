"""KVCache: slots allocated and freed, positions moved in every layer."""

import pytest
import torch

from specserve.kv_cache import KVCache


def test_slots_are_allocated_once_and_freed_back():
    c = KVCache(2, 3, 1, 8, 4, torch.float32, torch.device("cpu"))
    slots = [c.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and c.num_free_slots == 0
    with pytest.raises(AssertionError, match="no free KV slot"):
        c.allocate()
    c.free(slots[1])
    assert c.num_free_slots == 1 and c.allocate() == slots[1]
    with pytest.raises(AssertionError):
        c.free(7)                                    # not a slot


def test_move_copies_positions_of_one_slot_in_every_layer():
    c = KVCache(2, 2, 1, 8, 4, torch.float32, torch.device("cpu"))
    for li, (k, v) in enumerate(c.layers):
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).view_as(k) + 1000 * li)
        v.copy_(-k)
    before = [(k.clone(), v.clone()) for k, v in c.layers]
    c.move(1, [5, 6], [2, 3])
    for (k, v), (k0, v0) in zip(c.layers, before):
        assert torch.equal(k[1, :, 2:4], k0[1, :, 5:7]) and torch.equal(v[1, :, 2:4], v0[1, :, 5:7])
        assert torch.equal(k[0], k0[0])              # the other slot is untouched
        assert torch.equal(k[1, :, 4:], k0[1, :, 4:])
    assert c.nbytes() == 2 * 2 * 2 * 8 * 4 * 4
