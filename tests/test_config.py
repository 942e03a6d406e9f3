"""Every speculative_config validation message, and the CLI/YAML forms."""

from __future__ import annotations

import json

import pytest

from specserve.config import load_json_or_yaml_arg
from specserve.methods import resolve_speculative_config


@pytest.mark.parametrize("cfg, match", [
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be an int > 0, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 200}, "above the limit of 128"),
    ({"method": "magic", "num_speculative_tokens": 2}, "method 'magic' is not known"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "must be >= 1, got 0"),
    ({"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
     "prompt_lookup_min applies to method 'ngram' only"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 0},
     "suffix_decoding_max_tree_depth must be >= 1"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_cached_requests": -1},
     "suffix_decoding_max_cached_requests must be >= 0"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_spec_factor": -1},
     "suffix_decoding_max_spec_factor must be >= 0"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2},
     r"suffix_decoding_min_token_prob must be in \[0, 1\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
     "draft_tensor_parallel_size must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "tensor_parallel_size": 2},
     "use 'draft_tensor_parallel_size'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 1},
     "max_model_len must be >= 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "typical"},
     "rejection_sample_method 'typical' is not known"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"},
     "needs one of synthetic_acceptance_rate, synthetic_acceptance_rates"),
    ({"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_rate": 0.5},
     "only used with rejection_sample_method 'synthetic'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "beam"},
     "draft_sample_method must be 'greedy' or 'probabilistic'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "temperature": 0.5},
     "'temperature' is a sampling parameter"),
    ({"method": "ngram", "num_speculative_tokens": 2, "top_p": 0.5},
     "'top_p' is a sampling parameter"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_k": "yes"},
     "adaptive_k must be true or false, got 'yes'"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
      "draft_confidence_threshold": 1.0},
     r"draft_confidence_threshold must be a number in \[0, 1\), got 1.0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_confidence_threshold": 0.5},
     "draft_confidence_threshold applies to draft_model, eagle3, eagle, mtp, dflash, not 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     "unknown speculative_config key 'lookahead'; valid keys: method, model"),
])
def test_validation_messages(cfg, match):
    with pytest.raises(ValueError, match=match):
        resolve_speculative_config(cfg)


def test_defaults_and_mirroring():
    c = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                     "rejection_sample_method": "standard"})
    assert c.rejection_sample_method == "strict"


def test_method_inferred_from_model(tmp_path):
    d = tmp_path / "some-draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert resolve_speculative_config({"model": str(d), "num_speculative_tokens": 2}).method \
        == "draft_model"
    e = tmp_path / "heads"
    e.mkdir()
    (e / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"]}))
    assert resolve_speculative_config({"model": str(e), "num_speculative_tokens": 2}).method \
        == "medusa"
    assert resolve_speculative_config({"model": str(tmp_path / "x-eagle3-head"),
                                        "num_speculative_tokens": 2}).method == "eagle3"


def test_json_and_yaml_arguments(tmp_path):
    assert load_json_or_yaml_arg('{"method": "ngram", "num_speculative_tokens": 2}')["method"] \
        == "ngram"
    y = tmp_path / "spec.yaml"
    y.write_text("method: suffix\nnum_speculative_tokens: 4\n")
    assert load_json_or_yaml_arg(f"@{y}") == {"method": "suffix", "num_speculative_tokens": 4}
    # inline YAML text: `--speculative-config "$(cat spec.yaml)"`
    assert load_json_or_yaml_arg(y.read_text()) == {"method": "suffix",
                                                    "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="could not parse"):
        load_json_or_yaml_arg("{method: ngram")
    with pytest.raises(ValueError, match="does not exist"):
        load_json_or_yaml_arg("@/nonexistent.yaml")
    with pytest.raises(ValueError, match="expected a JSON/YAML mapping"):
        load_json_or_yaml_arg("[1, 2]")


def test_wrong_head_checkpoint_names_the_missing_tensor(llama_dir):
    from specserve import LLM
    with pytest.raises(ValueError, match="weights missing from the checkpoint: fc.weight"):
        LLM(str(llama_dir), speculative_config={"method": "eagle", "model": str(llama_dir),
                                                "num_speculative_tokens": 2})


@pytest.mark.parametrize("extra, rates", [
    ({"synthetic_acceptance_rate": 0.5}, [0.5, 0.5, 0.5]),
    ({"synthetic_acceptance_rates": [0.9, 0.6, 0.3]}, [0.9, 0.6 / 0.9, 0.3 / 0.6]),
    ({"synthetic_acceptance_length": 2.5}, [1.0, 0.5, 0.0]),        # [1, .5, 0] unconditional
    ({"synthetic_acceptance_length": 4}, [1.0, 1.0, 1.0]),
    ({"synthetic_acceptance_length": 1}, [0.0, 1.0, 1.0]),          # later positions unreached
])
def test_synthetic_schedules_become_conditional_rates(extra, rates):
    c = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                    "rejection_sample_method": "synthetic"} | extra)
    assert c.synthetic_rates() == pytest.approx(rates)


@pytest.mark.parametrize("extra, match", [
    ({"synthetic_acceptance_rates": [0.5, 0.6, 0.1]}, "non-increasing"),
    ({"synthetic_acceptance_rates": [0.5, 0.4]}, "K = 3"),
    ({"synthetic_acceptance_length": 4.5}, r"in \[1, K\+1\] = \[1, 4\]"),
    ({"synthetic_acceptance_length": 2, "synthetic_acceptance_rate": 0.5}, "needs one of"),
    ({}, "needs one of"),
])
def test_synthetic_schedule_errors(extra, match):
    with pytest.raises(ValueError, match=match):
        resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                    "rejection_sample_method": "synthetic"} | extra)


def test_synthetic_keys_need_synthetic():
    with pytest.raises(ValueError, match="synthetic_acceptance_length is only used with"):
        resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                    "synthetic_acceptance_length": 2})


@pytest.mark.parametrize("cfg, match", [
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 8},
     "suffix_decoding_max_tree_depth applies to method 'suffix' only"),
    ({"method": "eagle3", "model": "m", "draft_sample_method": "probabilistic"},
     "draft_sample_method 'probabilistic' applies to draft_model, dflash, not 'eagle3'"),
    ({"method": "draft_model", "model": "m", "rejection_sample_method": "probabilistic"},
     "set draft_sample_method 'probabilistic'"),
])
def test_keys_a_method_would_ignore_are_refused(cfg, match):
    """No key is accepted and then ignored: one that does nothing for the method is an error."""
    with pytest.raises(ValueError, match=match):
        resolve_speculative_config(cfg | {"num_speculative_tokens": 2})
    ok = {"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
          "draft_sample_method": "probabilistic", "rejection_sample_method": "probabilistic"}
    assert resolve_speculative_config(ok).rejection_sample_method == "probabilistic"
