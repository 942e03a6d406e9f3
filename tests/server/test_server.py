"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from specserve import LLM, SamplingParams
from specserve.config import ServerConfig
from specserve.engine.engine import LLMEngine
from specserve.llm import build_engine_config
from specserve.server.app import build_app
from tests.conftest import DEVICE

NAME = "tiny"


@contextlib.contextmanager
def live_server(model_dir, spec=None, server_kw=None, **engine_kw):
    engine = LLMEngine(build_engine_config(str(model_dir), spec, device=DEVICE, **engine_kw))
    app = build_app(engine, ServerConfig(served_model_name=NAME, max_request_bytes=64 * 1024,
                                         **(server_kw or {})))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine, app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(text_model_dir):
    with live_server(text_model_dir, max_model_len=128) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(text_model_dir):
    return LLM(str(text_model_dir), device=DEVICE, max_model_len=128)


GREEDY = dict(temperature=0, max_tokens=20)


def test_completion_equals_offline(client, offline):
    r = client.completions.create(model=NAME, prompt="def add(a, b):", **GREEDY)
    ref = offline.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=20),
                           use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=NAME, prompt="hello world", **GREEDY).choices[0].text
    chunks = list(client.completions.create(model=NAME, prompt="hello world", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_stop_string_never_streamed(client):
    full = client.completions.create(model=NAME, prompt="def add(a, b):", **GREEDY).choices[0].text
    stop = full[6:9]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="def add(a, b):", stream=True, stop=[stop], **GREEDY))
    assert streamed == full[:full.index(stop)]


def test_chat_equals_offline(client, offline):
    msgs = [{"role": "user", "content": "write add"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, **GREEDY)
    prompt = offline.get_tokenizer().apply_chat_template(msgs)
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20),
                           use_tqdm=False)[0].outputs[0]
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model=NAME, messages=msgs, stream=True, **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == ref.text
    assert stream[-1].choices[0].finish_reason == ref.finish_reason


def test_multiple_prompts_in_one_completion(client):
    r = client.completions.create(model=NAME, prompt=["hello", "def"], **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    single = client.completions.create(model=NAME, prompt="def", **GREEDY).choices[0].text
    assert r.choices[1].text == single


def test_sampled_stream_equals_non_stream(client):
    kw = dict(model=NAME, prompt="café ünïcode", temperature=1.0, seed=3, max_tokens=40)
    full = client.completions.create(**kw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == full


def test_concurrent_streams(server):
    async def one(c, i):
        text = ""
        stream = await c.completions.create(model=NAME, prompt=f"def f{i}(x):", stream=True,
                                            temperature=0.8, seed=i, max_tokens=16)
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x",
                                      max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(40)), return_exceptions=True)
    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]


def test_disconnect_aborts_and_frees_the_slot(server, monkeypatch):
    base, engine, app = server
    step = engine.step

    def slow_step():        # the request must still be running when the hang-up is noticed
        time.sleep(0.02)
        return step()
    monkeypatch.setattr(engine, "step", slow_step)
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", base + "/v1/completions", json={
                "model": NAME, "prompt": "hello", "max_tokens": 100, "ignore_eos": True,
                "stream": True, "temperature": 0}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    break                      # got the first chunk; now hang up
    deadline = time.time() + 10
    while engine.scheduler.running or app.state.async_engine.num_active:
        assert time.time() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert engine.cache.num_free_slots == engine.cache.num_slots
    abort = 'specserve:request_success_total{finished_reason="abort",model_name="tiny"}'
    while abort not in httpx.get(base + "/metrics").text:   # recorded as the stream closes
        assert time.time() < deadline, "the abort was not counted"
        time.sleep(0.05)


def test_many_requests_leave_nothing_behind(server):
    base, engine, app = server

    async def main():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as c:
            sem = asyncio.Semaphore(32)

            async def one(i):
                async with sem:
                    await c.completions.create(model=NAME, prompt=f"x{i}", max_tokens=2,
                                               temperature=0)
            await asyncio.gather(*(one(i) for i in range(1000)))
    asyncio.run(main())
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.cache.num_free_slots == engine.cache.num_slots
    assert app.state.async_engine.num_active == 0


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server[0] + "/health").status_code == 200
    m = httpx.get(server[0] + "/metrics").text
    for name in ("specserve:spec_decode_num_drafts_total", "specserve:time_to_first_token_seconds",
                 "specserve:inter_token_latency_seconds", "specserve:e2e_request_latency_seconds",
                 "specserve:num_requests_running", "specserve:num_requests_waiting",
                 'specserve:engine_alive{model_name="tiny"} 1.0'):
        assert name in m, name


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    (b'["a"]', 400, "must be a JSON object"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "bogus_field": 1}, 400, "unknown field 'bogus_field'"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ({"prompt": "x", "max_tokens": 1000}, 400, "maximum context length is 128 tokens"),
    ({"prompt": "hello " * 200, "max_tokens": 1}, 400, "shorten the prompt"),
    ({"prompt": "x", "temperature": -1}, 400,
     "temperature: Input should be greater than or equal to 0"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "the model 'gpt-9' does not exist"),
    ({"prompt": "x", "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ({"prompt": []}, 400, "prompt must not be an empty list"),
    ({"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    ({"prompt": [1, 99999], "stream": True}, 400, "outside the vocabulary"),
    ({"prompt": "x" * 70000}, 413, "larger than 65536 bytes"),
])
def test_bad_input_is_a_4xx_with_an_openai_error(server, body, status, message):
    base = server[0]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + "/v1/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_bad_chat_input(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_api_key(text_model_dir):
    with live_server(text_model_dir, server_kw={"api_key": "sekret"}) as (base, _, _):
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            bad.completions.create(model=NAME, prompt="x", max_tokens=2)
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=NAME, prompt="x", max_tokens=2).choices
        assert httpx.get(base + "/health").status_code == 200


def test_spec_metrics_when_asked(text_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with live_server(text_model_dir, spec=spec) as (base, _, _):
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model=NAME, prompt="hello hello hello hello", max_tokens=16,
                                 temperature=0, extra_body={"include_spec_metrics": True})
        sm = r.model_extra["spec_metrics"][0]
        assert sm["num_drafts"] >= 1 and 1.0 <= sm["mean_acceptance_length"] <= 4.0
        plain = c.completions.create(model=NAME, prompt="hello", max_tokens=4, temperature=0)
        assert "spec_metrics" not in (plain.model_extra or {})
        off = c.completions.create(model=NAME, prompt="hello hello hello hello", max_tokens=16,
                                   temperature=0, extra_body={"include_spec_metrics": True,
                                                              "num_speculative_tokens": 0})
        assert off.model_extra["spec_metrics"][0]["num_drafts"] == 0
        assert off.choices[0].text == r.choices[0].text
        m = httpx.get(base + "/metrics").text
        assert 'specserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in m


def test_prefix_cache_hits_in_usage_and_metrics(client, server):
    """A resent system prompt: the second answer's usage counts its cached prompt tokens, in
    the chat route and streamed completions alike, and /metrics counts them."""
    system = "def add(a, b):\n    return a + b\n" * 6
    chat = [client.chat.completions.create(
        model=NAME, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("hello", "world")]
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    cached = chat[1].usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < chat[1].usage.prompt_tokens
    client.completions.create(model=NAME, prompt=system + "hello", max_tokens=2)
    stream = client.completions.create(model=NAME, prompt=system + "world", max_tokens=2,
                                       stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens > 0
    m = httpx.get(server[0] + "/metrics").text
    hits = [line for line in m.splitlines()
            if line.startswith('specserve:prefix_cache_hits_total{model_name="tiny"}')]
    assert hits and float(hits[0].split()[-1]) >= cached + usage.prompt_tokens_details.cached_tokens
    assert 'specserve:prefix_cache_queries_total{model_name="tiny"}' in m


def test_structured_output_over_http(client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs and
    guided_* fields constrain the answer; a bad grammar or two constraints are 400s."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=NAME, max_tokens=40, temperature=0, messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3)
    for extra, check in (({"structured_outputs": {"choice": ["red", "green"]}},
                          lambda t: t in ("red", "green")),
                         ({"guided_regex": "[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
                         ({"structured_outputs": {"grammar": 'start: "a"+ "b"'}},
                          lambda t: t.rstrip("b") == "a" * (len(t) - 1) and t.endswith("b"))):
        c = client.completions.create(model=NAME, prompt="hello", max_tokens=20, temperature=0.8,
                                      seed=3, extra_body=extra)
        assert check(c.choices[0].text), (extra, c.choices[0].text)
    for extra, message in (({"guided_regex": "(unclosed"}, "structured_outputs"),
                           ({"guided_regex": "a", "guided_choice": ["b"]},
                            "give one of response_format, structured_outputs and guided_*"),
                           ({"response_format": {"type": "json_schema"}}, "needs json_schema")):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body=extra)


def test_tokenize_detokenize_version_model_routes(server):
    base = server[0]
    t = httpx.post(base + "/tokenize", json={"prompt": "hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 128
    assert httpx.post(base + "/detokenize", json={"tokens": t["tokens"]}).json() == {
        "prompt": "hello world"}
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["count"] > 1
    for body, message in (({"prompt": "x", "messages": []}, "give one of prompt and messages"),
                          ({"tokens": [10**9]}, "outside the vocabulary")):
        path = "/detokenize" if "tokens" in body else "/tokenize"
        r = httpx.post(base + path, json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert httpx.get(base + "/version").json()["version"]
    assert httpx.get(base + f"/v1/models/{NAME}").json()["id"] == NAME
    assert httpx.get(base + "/v1/models/other").status_code == 404
    assert httpx.head(base + "/health").status_code == 200


def test_penalties_and_logit_bias_over_http(client):
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0,
                                  logit_bias={"7": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text and client.completions.create(
        model=NAME, prompt="hello", max_tokens=6, temperature=0, presence_penalty=1.0,
        frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2}).choices
    for kw, message in (({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
                        ({"logit_bias": {"99999": 1}}, "outside the vocabulary"),
                        ({"presence_penalty": 5},
                         "presence_penalty: Input should be less than or equal to 2")):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            client.completions.create(model=NAME, prompt="x", max_tokens=2, **kw)


def test_n_samples_per_prompt(client):
    """n independent samples per prompt (seeds seed + i): choices ordered prompt by prompt,
    each its own draw, the same again for the same seed; chat refuses n > 1 by name."""
    r = client.completions.create(model=NAME, prompt=["hello", "world"], max_tokens=8, n=3,
                                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    texts = [c.text for c in r.choices]
    assert len(set(texts[:3])) > 1 and r.usage.completion_tokens == 48
    again = client.completions.create(model=NAME, prompt=["hello", "world"], max_tokens=8, n=3,
                                      temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts
    ones = [client.completions.create(model=NAME, prompt=p, max_tokens=1).usage.prompt_tokens
            for p in ("hello", "world")]
    assert r.usage.prompt_tokens == sum(ones)                  # each prompt counted once


def test_chat_n_choices_streamed_and_not(client):
    """Chat with n: n choices, sample i seeded seed + i as offline, the same streamed."""
    msgs = [{"role": "user", "content": "hello"}]
    kw = dict(model=NAME, messages=msgs, n=3, max_tokens=6, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert r.usage.completion_tokens == 18
    one = client.chat.completions.create(**kw | {"n": 1, "seed": 12})
    assert one.choices[0].message.content == texts[1]
    streamed = ["", "", ""]
    roles = set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.role == "assistant":
                roles.add(c.index)
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts and roles == {0, 1, 2}


def test_best_of_returns_the_most_likely_samples(client):
    """best_of draws that many samples and keeps the n whose tokens have the highest summed
    log-probability: the same samples drawn as n=best_of requests (seeds seed + i), ranked."""
    kw = dict(model=NAME, prompt="hello", max_tokens=6, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})
    every = client.completions.create(**kw, n=4, logprobs=0)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**kw, n=2, best_of=4)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    # every sample drawn is counted, the prompt once (OpenAI's usage for n and best_of)
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 24
    one = client.completions.create(**kw)
    assert best.usage.prompt_tokens == every.usage.prompt_tokens == one.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match=r"best_of \(1\) must be at least n"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, n=2, best_of=1)
    with pytest.raises(openai.BadRequestError, match="best_of > n cannot stream"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, best_of=2, stream=True)


def test_loglikelihood_requests_equal_transformers_on_smollm2(smollm2):
    """What lm-evaluation-harness's local-completions sends for log-likelihood tasks (echo,
    logprobs, max_tokens 0): the prompt's token log-probabilities, equal to transformers' own
    load of the GGUF within 1e-3 per token; with speculation on, the same."""
    import torch
    from transformers import AutoModelForCausalLM
    text = "The capital of France is Paris. The capital of Italy is Rome."
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with live_server(smollm2, spec=spec, max_num_seqs=2, max_model_len=256) as (base, eng, _):
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model=NAME, prompt=text, echo=True, logprobs=1, max_tokens=0)
        ids = eng.prompt_ids(text)
    choice = r.choices[0]
    assert choice.text == text and r.usage.completion_tokens == 0
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    ref_model = AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = ref_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ref = [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(got[1:], ref)) < 1e-3


def test_echo_with_a_completion(client):
    r = client.completions.create(model=NAME, prompt="hello", echo=True, logprobs=0,
                                  max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("hello") and lp.token_logprobs[0] is None
    assert len(lp.tokens) == r.usage.prompt_tokens + 3
    # streamed: the prompt (and its log-probabilities) comes first, then the same tokens
    text, tokens, lps = "", [], []
    for chunk in client.completions.create(model=NAME, prompt="hello", echo=True, logprobs=0,
                                           max_tokens=3, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens
            lps += c.logprobs.token_logprobs
    assert (text, tokens, lps) == (r.choices[0].text, lp.tokens, lp.token_logprobs)
    alone = list(client.completions.create(model=NAME, prompt="hello", echo=True, logprobs=0,
                                           max_tokens=0, stream=True))
    assert [c.text for ch in alone for c in ch.choices] == ["hello"]


def test_prompt_logprobs_field(client, server):
    """vLLM's prompt_logprobs: each prompt token's log-probability (None for the first), the
    same numbers as echo's, on both routes; refused with stream."""
    base = server[0]
    echo = client.completions.create(model=NAME, prompt="hello world", echo=True, logprobs=0,
                                     max_tokens=0)
    r = httpx.post(base + "/v1/completions", json={"prompt": "hello world", "max_tokens": 2,
                                                   "prompt_logprobs": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    ids = httpx.post(base + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    got = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], plp[1:])]
    assert got == pytest.approx(echo.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    assert all(1 <= len(entry) <= 2 for entry in plp[1:])
    chat = httpx.post(base + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_logprobs": 0}).json()
    assert chat["choices"][0]["prompt_logprobs"][0] is None
    bad = httpx.post(base + "/v1/completions", json={"prompt": "x", "prompt_logprobs": 1,
                                                     "stream": True})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.json()["error"]["message"]
