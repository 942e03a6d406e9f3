"""Loader errors name the file or tensor and say what to do."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.models.loader import load_model, save_model

CPU = torch.device("cpu")


@pytest.fixture
def model_copy(llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, CPU)


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_model(model_copy, torch.float32, CPU)


def test_corrupt_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(model_copy, torch.float32, CPU)


def test_pickle_only_is_refused(model_copy):
    (model_copy / "model.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ValueError, match="pytorch_model.bin.*convert them to safetensors|"
                                         "only pickle weights.*Convert them to safetensors"):
        load_model(model_copy, torch.float32, CPU)


def test_no_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(model_copy, torch.float32, CPU)


def test_corrupt_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x10\x00\x00garbage")
    with pytest.raises(ValueError, match="model.safetensors could not be read"):
        load_model(model_copy, torch.float32, CPU)


def test_missing_tensor(model_copy):
    t = load_file(model_copy / "model.safetensors")
    del t["model.layers.1.post_attention_layernorm.weight"]
    save_file(t, model_copy / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.post_attention_layernorm.weight"):
        load_model(model_copy, torch.float32, CPU)


def test_missing_k_proj_names_the_part(model_copy):
    t = load_file(model_copy / "model.safetensors")
    del t["model.layers.0.self_attn.k_proj.weight"]
    save_file(t, model_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"layer 0: tensors for \['k'\]"):
        load_model(model_copy, torch.float32, CPU)


def test_misshaped_tensor(model_copy):
    t = load_file(model_copy / "model.safetensors")
    t["model.norm.weight"] = torch.ones(63)
    save_file(t, model_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"norm.weight has shape \(63,\), expected \(64,\)"):
        load_model(model_copy, torch.float32, CPU)


def test_unknown_architecture(model_copy):
    _edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: Llama"):
        load_model(model_copy, torch.float32, CPU)


def test_unsupported_rope_type(model_copy):
    _edit_config(model_copy, rope_parameters={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        load_model(model_copy, torch.float32, CPU)


def test_sliding_window_needs_short_context(model_copy):
    _edit_config(model_copy, architectures=["MistralForCausalLM"], sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window attention .*max_model_len <= 64"):
        load_model(model_copy, torch.float32, CPU)
    model = load_model(model_copy, torch.float32, CPU, max_len=64)     # short enough: loads
    assert model.args.sliding_window == 64 and model.rotary.cos_sin.shape[0] >= 64


def test_sharded_round_trip(llama_dir, tmp_path):
    m = load_model(llama_dir, torch.float32, CPU)
    save_model(m, tmp_path / "sharded", dtype=torch.float32, max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    m2 = load_model(tmp_path / "sharded", torch.float32, CPU)
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


def test_missing_shard(llama_dir, tmp_path):
    m = load_model(llama_dir, torch.float32, CPU)
    save_model(m, tmp_path / "s", dtype=torch.float32, max_shard_bytes=20_000)
    next((tmp_path / "s").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shard model-00002-of-.* is missing"):
        load_model(tmp_path / "s", torch.float32, CPU)
