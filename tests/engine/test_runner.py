"""ModelRunner.execute: one ragged forward for a mixed batch; logits at the sampled rows only,
equal to each request run alone."""

from __future__ import annotations

import torch

from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner
from specserve.engine.scheduler import ScheduledRequest
from specserve.models.backend import make_kv_cache
from specserve.models.loader import load_model
from specserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _request(rid: str, ids: list[int], slot: int) -> Request:
    r = Request(rid, None, ids, SamplingParams(), torch.Generator(), max_total_tokens=64)
    r.slot = slot
    return r


def test_a_mixed_batch_gives_each_request_its_own_logits(llama_dir):
    model = load_model(llama_dir, torch.float32, CPU)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    alone = []
    for ids in prompts:            # each prompt alone, whole: its last row's logits
        runner = ModelRunner(model, make_kv_cache(model, 2, 64), CPU)
        out = runner.execute([ScheduledRequest(_request("x", ids, 0), len(ids), 0, 1)])
        alone.append(out.logits[0])
    runner = ModelRunner(model, make_kv_cache(model, 2, 64), CPU)
    a, b = _request("a", prompts[0], 0), _request("b", prompts[1], 1)
    # a: a prompt chunk of 3 (no sampled row), b: its whole prompt (one sampled row)
    out = runner.execute([ScheduledRequest(a, 3, 0, 0), ScheduledRequest(b, 3, 0, 1)])
    assert out.logits.shape == (1, model.args.vocab_size)
    assert out.cu_num_tokens == [0, 3, 6] and out.starts == [0, 0]
    assert out.hidden.shape == (6, model.args.hidden_size)
    torch.testing.assert_close(out.logits[0], alone[1], atol=1e-5, rtol=1e-5)
    a.num_computed_tokens = 3      # the rest of a's prompt: its last row is sampled
    out = runner.execute([ScheduledRequest(a, 2, 0, 1)])
    torch.testing.assert_close(out.logits[0], alone[0], atol=1e-5, rtol=1e-5)
    assert out.rows(0, 5) == (0, 2)
