"""LLM.generate: greedy equality with transformers, batching, stop conditions, seeds, errors."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams, TokensPrompt
from tests.conftest import DEVICE

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def prompts(n: int, seed: int = 0, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def test_greedy_alone_and_batched_equal_transformers(hf_model):
    _, path, hf = hf_model
    ps = prompts(6)
    ref = [hf_greedy(hf, p, 24) for p in ps]
    # Small token budget: long prompts are prefilled in chunks while others decode.
    llm = LLM(str(path), device=DEVICE, max_num_seqs=4, max_num_batched_tokens=16)
    alone = [llm.generate([TokensPrompt(prompt_token_ids=p)], GREEDY, use_tqdm=False)[0]
             for p in ps[:2]]
    assert [o.outputs[0].token_ids for o in alone] == ref[:2]
    batched = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == ref
    assert all(o.outputs[0].finish_reason == "length" for o in batched)


def test_outputs_keep_prompt_order_and_accept_param_lists(llama_dir):
    llm = LLM(str(llama_dir), device=DEVICE)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(3, seed=1)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in ps]
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        llm.generate(ps, params[:2], use_tqdm=False)


def test_eos_stops_unless_ignored(llama_dir):
    llm = LLM(str(llama_dir), device=DEVICE)
    p = TokensPrompt(prompt_token_ids=prompts(1, seed=2)[0])
    free = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    # Make the 4th generated token the EOS: generation must stop right there.
    llm.engine.eos_token_ids = frozenset({free[3]})
    first = free.index(free[3])
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_stop_token_ids(llama_dir):
    llm = LLM(str(llama_dir), device=DEVICE)
    p = TokensPrompt(prompt_token_ids=prompts(1, seed=3)[0])
    free = llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = free[5]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                         stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:free.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_cut_at_the_right_place(text_model_dir):
    llm = LLM(str(text_model_dir), device=DEVICE)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = llm.generate("def add(a, b):", sp, use_tqdm=False)[0].outputs[0].text
    assert len(free) > 6
    stop = free[3:5]
    cut = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=40,
                       ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == free[:free.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("def add(a, b):", SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == free[:free.index(stop) + len(stop)]


def test_text_equals_decoded_tokens(text_model_dir):
    llm = LLM(str(text_model_dir), device=DEVICE)
    out = llm.generate(["hello", "café"], SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                                                           ignore_eos=True), use_tqdm=False)
    tok = llm.get_tokenizer()
    for o in out:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)


def test_seeded_sampling_is_independent_of_batch(llama_dir):
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    p = TokensPrompt(prompt_token_ids=prompts(1, seed=4)[0])
    alone = LLM(str(llama_dir), device=DEVICE).generate(p, sp, use_tqdm=False)[0]
    others = [TokensPrompt(prompt_token_ids=q) for q in prompts(5, seed=5)]
    mixed = LLM(str(llama_dir), device=DEVICE, max_num_batched_tokens=24).generate(
        others[:2] + [p] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)] * 2 + [sp]
        + [GREEDY] * 3, use_tqdm=False)[2]
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids
    different = LLM(str(llama_dir), device=DEVICE).generate(
        p, SamplingParams(temperature=0.9, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True),
        use_tqdm=False)[0]
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_logprobs(llama_dir, hf_model=None):
    llm = LLM(str(llama_dir), device=DEVICE)
    p = prompts(1, seed=6)[0]
    out = llm.generate(TokensPrompt(prompt_token_ids=p), SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) <= 3
        assert lp[tok] == max(lp.values())      # greedy: the sampled token is the top one


def test_max_model_len_limits_output(llama_dir):
    llm = LLM(str(llama_dir), device=DEVICE, max_model_len=32)
    out = llm.generate(TokensPrompt(prompt_token_ids=list(range(30))),
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs, prompt, match", [
    ({"max_model_len": 16}, list(range(16)), "prompt has 16 tokens, but the context length"),
    ({}, [], "the prompt is empty"),
    ({}, [1, 500], r"outside the vocabulary \[0, 96\)"),
    ({}, "text", r"no tokenizer \(no tokenizer.json\); give token ids"),
])
def test_bad_prompts(llama_dir, kwargs, prompt, match):
    llm = LLM(str(llama_dir), device=DEVICE, **kwargs)
    p = prompt if isinstance(prompt, str) else TokensPrompt(prompt_token_ids=prompt)
    with pytest.raises(ValueError, match=match):
        llm.generate(p, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_model_len": 4096}, "max_model_len=4096 is larger than the model's context"),
    ({"dtype": "float64"}, "dtype 'float64' is not supported"),
    ({"device": "tpu"}, "device 'tpu' is not supported"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "max_num_batched_tokens .* must be >="),
])
def test_bad_engine_args(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), **kwargs)


def test_unknown_engine_arg(llama_dir):
    with pytest.raises(TypeError, match="unknown engine argument.*'max_batch'"):
        LLM(str(llama_dir), max_batch=3)


def test_the_engine_leaves_the_garbage_collector_alone_unless_asked(llama_dir):
    """freeze_gc=True takes the models and caches out of the cyclic collector's walk (vLLM
    freezes its engine heap the same way); by default the process's collector is untouched."""
    import gc
    gc.unfreeze()
    LLM(str(llama_dir), device=DEVICE)
    assert gc.get_freeze_count() == 0
    llm = LLM(str(llama_dir), device=DEVICE, freeze_gc=True)
    walked = {id(o) for o in gc.get_objects()}
    assert id(llm.engine.model) not in walked and id(llm.engine.cache) not in walked
    assert id(llm.engine.model.layers[0]) not in walked
    gc.unfreeze()


def test_a_closed_frozen_engine_is_freed(llama_dir):
    """Closing an engine that froze the collector lets its models go: a benchmark's engines,
    one set after another, stayed resident until the machine ran out of memory."""
    import gc
    import weakref
    llm = LLM(str(llama_dir), device=DEVICE, freeze_gc=True)
    model = weakref.ref(llm.engine.model)
    llm.engine.close()
    del llm
    gc.collect()
    assert model() is None


def test_the_engine_logs_its_backends_in_one_line(llama_dir, draft_dir, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="specserve")
    LLM(str(llama_dir), device="cpu", cpu_kernel=False,
        speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2})
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend:")]
    assert line.startswith("backend: target pytorch cpu")
    assert "; draft model pytorch cpu" in line and "float32" in line and "threads" in line


def test_chat_renders_the_template_and_generates(text_model_dir):
    llm = LLM(str(text_model_dir), device=DEVICE, max_model_len=128)
    msgs = [{"role": "user", "content": "write add"}]
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = llm.get_tokenizer().apply_chat_template(msgs)
    (ref,) = llm.generate(prompt, params, use_tqdm=False)
    (one,) = llm.chat(msgs, params, use_tqdm=False)
    assert one.prompt == prompt and one.outputs[0].token_ids == ref.outputs[0].token_ids
    two = llm.chat([msgs, msgs + [{"role": "assistant", "content": "ok"}]], params,
                   use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == ref.outputs[0].token_ids


def test_chat_without_a_tokenizer_says_so(llama_dir):
    with pytest.raises(ValueError, match="no tokenizer .*chat is not available"):
        LLM(str(llama_dir), device=DEVICE).chat([{"role": "user", "content": "hi"}])


def test_get_metrics_gives_vllm_shaped_objects_and_get_stats_the_dict(llama_dir):
    llm = LLM(str(llama_dir), device=DEVICE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    llm.generate([TokensPrompt(prompt_token_ids=[4, 5, 4, 5, 4, 5])], GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    got = {m.name: getattr(m, "value", None) if hasattr(m, "value") else m.values
           for m in llm.get_metrics()}
    assert got == {"vllm:spec_decode_num_drafts": stats["spec_decode_num_drafts"],
                   "vllm:spec_decode_num_draft_tokens": stats["spec_decode_num_draft_tokens"],
                   "vllm:spec_decode_num_accepted_tokens":
                       stats["spec_decode_num_accepted_tokens"],
                   "vllm:spec_decode_num_accepted_tokens_per_pos":
                       stats["spec_decode_num_accepted_tokens_per_pos"]}
    assert stats["spec_decode_num_drafts"] > 0
