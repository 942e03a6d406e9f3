"""Fuzz every POST route in-process: whatever the body, the answer is never a 5xx, and the
engine answers a known greedy request the same way afterwards."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.config import ServerConfig
from specserve.engine.engine import LLMEngine
from specserve.llm import build_engine_config
from specserve.server.app import build_app
from tests.conftest import DEVICE

GREEDY = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}

# every sampling-parameter boundary, and values of every wrong kind
_floats = st.sampled_from([0.0, -0.0, 1e-46, 7e-46, 1.4e-45, 1e-40, 1e-38, 1e-6, 1e-5, 0.5, 1.0,
                           1.0000001, 2.0, -1.0, 1e308, float("nan"), float("inf"),
                           float("-inf")]) | st.floats()
_ints = st.sampled_from([-(2**63) - 1, -(2**63), -2, -1, 0, 1, 2, 20, 21, 95, 96, 127, 128,
                         2**31, 2**63, 2**64 - 1, 2**64, 10**30]) | st.integers()
_clean_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_text = _clean_text | st.sampled_from(["\ud83d\ude80", "", "\x00", "x" * 300, "a\udfffb"])
_scalar = _floats | _ints | _text | st.booleans() | st.none()
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(_clean_text, inner, max_size=3), max_leaves=8)
# mostly the right type at its boundaries, so that bodies reach the sampler
_typed = {"temperature": _floats, "top_p": _floats, "min_p": _floats, "top_k": _ints,
          "seed": _ints, "max_tokens": _ints, "logprobs": _ints, "n": _ints,
          "stop": st.lists(_text, max_size=3) | _text, "stop_token_ids": st.lists(_ints, max_size=3),
          "ignore_eos": st.booleans(), "stream": st.booleans(), "model": _text,
          "presence_penalty": _floats, "logit_bias": st.dictionaries(_text, _floats, max_size=2),
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
          "include_stop_str_in_output": st.booleans()}
_field = st.sampled_from(sorted(_typed)).flatmap(
    lambda k: st.tuples(st.just(k), _typed[k] | _value))
_fields = st.lists(_field, max_size=4).map(dict) | st.dictionaries(st.just("bogus"), _value)
_prompt = (st.sampled_from(["x", "def f():", "\ud800"]) | _clean_text.filter(bool)
           | st.lists(_ints, min_size=1, max_size=5) | st.lists(st.lists(_ints, max_size=3),
                                                              max_size=3) | _value)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                  "content": _clean_text | _text | _value})
_messages = st.lists(_message, min_size=1, max_size=3) | _value
# valid bodies but for sampling parameters at their boundaries: these reach the sampler
_boundary = st.lists(st.sampled_from(["temperature", "top_p", "min_p", "top_k", "seed",
                                      "max_tokens", "logprobs", "stop", "stop_token_ids",
                                      "ignore_eos", "stream"]).flatmap(
    lambda k: st.tuples(st.just(k), _typed[k])), min_size=1, max_size=4).map(dict)
_sampling = st.builds(lambda f, chat: ({"messages": [{"role": "user", "content": "hi"}]} if chat
                                       else {"prompt": "def f():"}) | {"max_tokens": 3} | f,
                      _boundary, st.booleans())
_completion = st.builds(lambda p, f: {"prompt": p, "max_tokens": 3} | f, _prompt, _fields)
_chat_extra = st.dictionaries(st.sampled_from(["top_logprobs", "logprobs",
                                               "max_completion_tokens"]), _ints | _value,
                              max_size=2)
_chat = st.builds(lambda m, f, g: {"messages": m, "max_tokens": 3} | f | g, _messages, _fields,
                  _chat_extra)


@pytest.fixture(scope="module")
def fuzz_client(text_model_dir):
    engine = LLMEngine(build_engine_config(str(text_model_dir), None, device=DEVICE,
                                           max_model_len=128))
    app = build_app(engine, ServerConfig(max_request_bytes=64 * 1024))
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as c:
        yield c


def _send(c: TestClient, path: str, body) -> None:
    content = json.dumps(body, allow_nan=True).encode()      # NaN / Infinity literals too
    with c.stream("POST", path, content=content,
                  headers={"content-type": "application/json"}) as r:
        text = "".join(r.iter_text())
        assert r.status_code < 500, (body, r.status_code, text[:300])
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]")
            assert '"server_error"' not in text, (body, text[-300:])


_settings = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


@_settings
@given(body=_completion)
def test_fuzz_completions(fuzz_client, body):
    _send(fuzz_client, "/v1/completions", body)


@_settings
@given(body=_chat)
def test_fuzz_chat(fuzz_client, body):
    _send(fuzz_client, "/v1/chat/completions", body)


@_settings
@given(body=_sampling)
def test_fuzz_sampling_parameters(fuzz_client, body):
    _send(fuzz_client, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)


def test_engine_answers_the_same_after_the_fuzz(fuzz_client, text_model_dir):
    from specserve import LLM, SamplingParams
    ref = LLM(str(text_model_dir), device=DEVICE, max_model_len=128).generate(
        GREEDY["prompt"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert fuzz_client.get("/health").status_code == 200
    r = fuzz_client.post("/v1/completions", json=GREEDY)
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text
