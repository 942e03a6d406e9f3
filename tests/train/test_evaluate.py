"""Zoo evaluation helpers."""

from __future__ import annotations

import torch

from tests.train.conftest import REPO


def test_greedy_top1_probs_are_the_targets_top_probabilities():
    from specserve.models.loader import load_model
    from specserve.train.evaluate import greedy_completions, greedy_top1_probs
    from specserve.train.trainer import _positions
    target = str(REPO / "models" / "code-target")
    out = greedy_completions(target, ["def add(a, b):\n"], max_tokens=12)
    probs = greedy_top1_probs(out)
    seq = torch.tensor(out[0].prompt_token_ids + out[0].outputs[0].token_ids)[None]
    model = load_model(target, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        p = model.compute_logits(model(seq, _positions(seq)))[0].softmax(-1)      # [S, V]
    n = len(out[0].prompt_token_ids)
    top = p[n - 1:-1].max(-1).values
    assert len(probs) == 12 and torch.allclose(torch.tensor(probs), top, atol=1e-4)
