"""Tensor parallelism over 2 gloo ranks on the CPU: the same logits and greedy output as one
rank for every architecture and the main methods, the drafter on rank 0, the server, errors
that say what to change, and no worker left behind."""

from __future__ import annotations

import gc
import multiprocessing

import openai
import pytest

from specserve import LLM, SamplingParams, TokensPrompt
from tests.test_spec_decode import _greedy, repetitive_prompts
from tests.train.conftest import REPO

ZOO = REPO / "models"

TP = 2


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    yield
    gc.collect()
    assert multiprocessing.active_children() == []


def _logprobs(llm: LLM, prompts) -> list[list[dict[int, float]]]:
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    return [o.outputs[0].logprobs for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_two_ranks_give_one_ranks_logits_for_every_architecture(hf_model):
    arch, path, _ = hf_model
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(2, seed=1)]
    want = _logprobs(LLM(str(path), device="cpu"), ps)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=TP)
    got = _logprobs(llm, ps)
    llm.engine.close()
    for g, w in zip(got, want):
        assert [list(x) for x in g] == [list(x) for x in w], arch        # the same top tokens
        for gx, wx in zip(g, w):
            assert gx == pytest.approx(wx, abs=1e-4), arch             # float32 sum order


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "eagle3"])
def test_greedy_output_with_two_ranks_is_one_ranks(method, llama_dir, draft_dir, tmp_path):
    from tests.methods.test_heads import eagle3_ckpt
    spec = {"none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
            "draft_model": {"model": str(draft_dir), "num_speculative_tokens": 3},
            "eagle3": {"model": str(eagle3_ckpt(tmp_path / "e3")), "num_speculative_tokens": 3,
                       "draft_tensor_parallel_size": 1}}[method]
    ps = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(5, seed=2)]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device="cpu").generate(
        ps, _greedy(30), use_tqdm=False)]
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP, max_num_seqs=3,
              max_num_batched_tokens=16, speculative_config=spec)   # chunks, continuous batching
    assert [o.outputs[0].token_ids for o in llm.generate(ps, _greedy(30), use_tqdm=False)] == ref
    llm.engine.close()


def test_the_seeds_eagle_example_runs_on_two_ranks():
    llm = LLM(model=str(ZOO / "code-target"), tensor_parallel_size=2, speculative_config={
        "model": str(ZOO / "code-target-eagle3"), "draft_tensor_parallel_size": 1,
        "num_speculative_tokens": 2, "method": "eagle3"})
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=24))
    assert len(out[0].outputs[0].token_ids) == 24
    assert llm.get_stats()["mean_acceptance_length"] > 1.2


def test_the_server_answers_on_two_ranks(text_model_dir):
    from tests.server.test_server import NAME, live_server
    with live_server(text_model_dir, max_model_len=128, tensor_parallel_size=TP) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=NAME, prompt="def add(a, b):", temperature=0,
                                      max_tokens=12)
    ref = LLM(str(text_model_dir), device="cpu", max_model_len=128).generate(
        "def add(a, b):", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert r.choices[0].text == ref[0].outputs[0].text


def test_sizes_that_cannot_split_the_model_are_refused_before_any_process(llama_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's 4 "
                                         r"attention heads; use one of \[1, 2\]"):
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="must be 1 or equal to tensor_parallel_size=2"):
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 4})
    assert multiprocessing.active_children() == []


def test_a_worker_that_dies_stops_the_engine_with_a_message(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP)
    llm.engine.tp.workers[0].kill()
    llm.engine.tp.workers[0].join()
    with pytest.raises(RuntimeError, match="tensor-parallel worker specserve-tp-rank1 died"):
        llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]), _greedy(4), use_tqdm=False)
    llm.engine.close()


def test_workers_stop_when_the_engine_is_collected(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=TP)
    workers = list(llm.engine.tp.workers)
    assert all(w.is_alive() for w in workers)
    del llm
    gc.collect()
    assert not any(w.is_alive() for w in workers)
