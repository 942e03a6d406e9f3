"""Rope types as transformers computes them: logits of tiny Llamas with each scaling equal
transformers' (prefill over positions that cross the original context)."""

from __future__ import annotations

import pytest
import torch

from specserve.models.loader import load_model
from tests.conftest import make_hf_model

ROPES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                    "original_max_position_embeddings": 32, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("kind", ROPES)
def test_rope_type_matches_transformers(kind, tmp_path):
    hf = make_hf_model("llama", tmp_path, rope_parameters=ROPES[kind])
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        out = model.compute_logits(model(ids, torch.arange(120)[None]))[0]
    assert (out - ref).abs().max() < 1e-4

