"""Scheduling under a token budget: chunked prefill, admission, drafts never starve requests."""

from __future__ import annotations

import torch

from specserve.config import SchedulerConfig
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.kv_cache import KVCache
from specserve.sampling_params import SamplingParams


def _req(i: int, prompt_len: int) -> Request:
    return Request(str(i), None, list(range(prompt_len)), SamplingParams(temperature=0),
                   torch.Generator(), max_total_tokens=1000)


def _scheduler(max_seqs: int, budget: int) -> Scheduler:
    cache = KVCache(1, max_seqs, 1, 8, 2, torch.float32, torch.device("cpu"))
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), [cache])


def _decoding(s: Scheduler, reqs: list[Request], drafts: int) -> None:
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
        r.spec_token_ids = list(range(drafts))


def test_long_prompt_is_prefilled_in_chunks():
    s = _scheduler(2, 16)
    r = _req(0, 40)
    s.add(r)
    sizes = []
    while r.num_computed_tokens < r.num_tokens:
        (item,) = s.schedule()
        sizes.append(item.num_new_tokens)
        last = item.num_sample_rows
        r.num_computed_tokens += item.num_new_tokens
    assert sizes == [16, 16, 8] and last == 1


def test_drafts_do_not_starve_running_requests():
    s = _scheduler(6, 8)
    reqs = [_req(i, 3) for i in range(6)]
    for r in reqs:
        s.add(r)
    s.schedule()
    _decoding(s, reqs, drafts=4)
    items = s.schedule()
    assert [it.request.request_id for it in items] == [str(i) for i in range(6)]
    assert sum(it.num_new_tokens for it in items) <= 8
    assert [it.num_spec_tokens for it in items] == [2, 0, 0, 0, 0, 0]
    assert reqs[1].spec_token_ids == []          # trimmed drafts are dropped, not kept stale


def test_admission_respects_slots_and_max_num_seqs():
    s = _scheduler(2, 64)
    for i in range(3):
        s.add(_req(i, 4))
    items = s.schedule()
    assert len(items) == 2 and len(s.waiting) == 1
    s.finish(items[0].request)
    assert [it.request.request_id for it in s.schedule()] == ["1", "2"]
