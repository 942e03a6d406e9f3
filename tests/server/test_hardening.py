"""What a hostile or careless client may send: every input error is a 4xx that names the fix,
a request that fails inside the engine fails alone, and a dead engine answers 503 at once."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from specserve.config import ServerConfig
from specserve.engine.engine import LLMEngine
from specserve.llm import build_engine_config
from specserve.server.app import build_app
from specserve.server.serve import serve
from tests.conftest import DEVICE

NAME = "tiny"
GREEDY = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
JSON = {"content-type": "application/json"}


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(build_engine_config(str(model_dir), None, device=DEVICE, max_model_len=128,
                                         **kw))


@pytest.fixture
def make_client(text_model_dir):
    """An in-process app (engine thread started) behind a TestClient on http://localhost."""
    clients = []

    def make(engine=None, **server_kw):
        app = build_app(engine or _engine(text_model_dir),
                        ServerConfig(served_model_name=NAME, max_request_bytes=64 * 1024,
                                     **server_kw))
        c = TestClient(app, base_url="http://localhost", raise_server_exceptions=False)
        c.__enter__()
        clients.append(c)
        return c
    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def client(make_client):
    return make_client()


def _post(c, path: str, body, headers=JSON):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.post(path, content=content, headers=headers)


# ---- sampling parameters ------------------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "x", "max_tokens": 4, "top_p": 1e-46}', "top_p must be in (0, 1]"),
    (b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "x", "max_tokens": 4, "temperature": Infinity}', "Infinity is not a JSON"),
    (b'{"prompt": "x", "max_tokens": 4, "temperature": 1e999}', "temperature must be a finite"),
    (b'{"prompt": "x", "max_tokens": 4, "temperature": 1e-40}', "at least 1e-05"),
    (b'{"prompt": "x", "max_tokens": 4, "temperature": 1e-40, "top_k": 3}', "at least 1e-05"),
    (b'{"prompt": "x", "max_tokens": 4, "seed": 18446744073709551616}',
     "seed: Input should be less than or equal to 18446744073709551615"),
    (b'{"prompt": "x", "max_tokens": 4, "min_p": -0.5}',
     "min_p: Input should be greater than or equal to 0"),
])
def test_degenerate_sampling_values_are_400s_and_the_engine_lives(client, body, message):
    before = _post(client, "/v1/completions", GREEDY).json()["choices"][0]["text"]
    r = _post(client, "/v1/completions", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    chat = body.replace(b'"prompt": "x"', b'"messages": [{"role": "user", "content": "x"}]')
    assert _post(client, "/v1/chat/completions", chat).status_code == 400
    assert client.get("/health").status_code == 200
    assert _post(client, "/v1/completions", GREEDY).json()["choices"][0]["text"] == before


# ---- bodies, headers, limits --------------------------------------------------------------------
@pytest.mark.parametrize("body, status, message", [
    (b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "lone UTF-16 surrogate"),
    (b'{"prompt": "x", "model": "\\udfff"}', 400, "lone UTF-16 surrogate"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
    (b'{"prompt": "x", "stop": [' + b"[" * 900 + b"]" * 900 + b"]}", 400, "nested too deeply"),
    (b'{"prompt": "x", "stop": [[1]]}', 400, "stop"),
    (json.dumps({"prompt": [[1]] * 65}).encode(), 400, "send at most 64 per request"),
    (json.dumps({"prompt": [[1] * 100] * 11, "max_tokens": 1}).encode(), 400,
     "more than 1024 tokens in all"),
])
def test_bad_bodies_are_400s(client, body, status, message):
    r = _post(client, "/v1/completions", body)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text[:300]


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "stop": ["a"] * 17}, "17 stop strings; at most 16 are allowed (the server's "
                                          "--max-stop)"),
    ({"prompt": "x", "stop_token_ids": list(range(17))}, "17 stop_token_ids; at most 16"),
    ({"prompt": "x", "stop": "a" * 257}, "longer than 256 characters (the server's "
                                         "--max-stop-chars)"),
    ({"prompt": "x", "stop_token_ids": [2**70]}, "outside the vocabulary"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "outside the vocabulary"),
    ({"prompt": [[1]] * 64}, "more than 1024 tokens over its prompts (max_tokens x prompts x "
                             "samples; the server's --max-tokens-per-request)"),
    ({"prompt": "x", "num_speculative_tokens": 1}, "num_speculative_tokens=1 is more than this "
                                                   "server's 0"),
    ({"prompt": "x", "num_speculative_tokens": -1}, "num_speculative_tokens"),
])
def test_limits_say_what_they_are(client, body, message):
    r = _post(client, "/v1/completions", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text[:300]
    assert _post(client, "/v1/completions", GREEDY).status_code == 200


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "4"), ("max_tokens", True), ("max_tokens", 4.0), ("stream", "yes"),
    ("stream", 1), ("prompt", [[False]]), ("prompt", [["1"]]), ("seed", "7"), ("top_k", 2.5),
    ("stop_token_ids", [True]), ("num_speculative_tokens", "1"), ("logprobs", False),
])
def test_no_type_coercion(client, field, value):
    """A string is not a number, a bool is not a token id: what the schema forbids is a 400
    naming the field, never read as something else."""
    r = _post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2} | {field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text[:300]


def test_limit_flags(make_client):
    c = make_client(max_stop=2, max_stop_chars=3, default_max_tokens=5, max_tokens_per_request=9)
    assert _post(c, "/v1/completions", {"prompt": "x", "stop": ["abc", "de"]}).status_code == 200
    assert "at most 2" in _post(c, "/v1/completions", {"prompt": "x", "stop": ["a"] * 3}).text
    r = _post(c, "/v1/completions", {"prompt": "x", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 5          # default_max_tokens
    assert _post(c, "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 4}).status_code == 200
    r = _post(c, "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 5})
    assert r.status_code == 400 and "more than 9 tokens over its prompts" in r.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "%s", "max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": ["ok", "%s"], "max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": "%s", "max_tokens": 4, "stream": true}'),
    ("/v1/completions", b'{"prompt": "x", "model": "%s"}'),
    ("/v1/completions", b'{"prompt": "x", "stop": ["%s"]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "%s"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "%s", "content": "hi"}]}'),
])
def test_raw_surrogate_bytes_in_any_string_are_400s(client, path, body):
    """UTF-8 bytes of a lone surrogate (not an escape): not UTF-8, so a 400, never a 500."""
    r = _post(client, path, body.replace(b"%s", b"\xed\xa0\x80"))
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"], r.text


def test_lone_surrogates_in_chat_are_400s(client):
    for body in (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                 b'{"messages": [{"role": "user", "content": [{"type": "text", '
                 b'"text": "\\udc00"}]}]}'):
        r = _post(client, "/v1/chat/completions", body)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    ok = _post(client, "/v1/chat/completions",                  # a proper pair is fine
               b'{"messages": [{"role": "user", "content": "\\ud83d\\ude80"}], "max_tokens": 2}')
    assert ok.status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
def test_only_json_bodies_are_accepted(client, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=json.dumps(GREEDY).encode(), headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert _post(client, "/v1/completions", GREEDY,
                 {"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_host_header_is_checked(client, make_client):
    for host in ("evil.example", "localhost.evil.example", "127.0.0.2"):
        r = client.get("/v1/models", headers={"host": host})
        assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"]
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
        assert client.get("/v1/models", headers={"host": host}).status_code == 200
    other = make_client(allowed_hosts="api.example, localhost")
    assert other.get("/v1/models", headers={"host": "api.example:443"}).status_code == 200
    assert other.get("/v1/models", headers={"host": "127.0.0.1"}).status_code == 400
    anyhost = make_client(host="0.0.0.0")
    assert anyhost.get("/v1/models", headers={"host": "10.1.2.3"}).status_code == 200


def test_cors_is_off_unless_origins_are_given(client, make_client):
    pre = {"origin": "http://page.example", "access-control-request-method": "POST",
           "access-control-request-headers": "content-type"}
    r = client.options("/v1/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    r = client.post("/v1/completions", content=json.dumps(GREEDY).encode(),
                    headers=JSON | {"origin": "http://page.example"})
    assert "access-control-allow-origin" not in r.headers
    c = make_client(allowed_origins="http://page.example")
    r = c.options("/v1/completions", headers=pre)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://page.example"
    r = c.options("/v1/completions", headers=pre | {"origin": "http://other.example"})
    assert r.headers.get("access-control-allow-origin") != "http://other.example"


def test_api_key_guards_metrics_and_docs(make_client):
    c = make_client(api_key="sekret")
    key = {"authorization": "Bearer sekret"}
    for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"):
        assert c.get(path).status_code == 401, path
        assert c.get(path, headers=key).status_code == 200, path
    assert c.get("/health").status_code == 200
    pub = make_client(api_key="sekret", public_metrics=True)
    assert pub.get("/metrics").status_code == 200 and pub.get("/docs").status_code == 200
    assert pub.get("/v1/models").status_code == 401


def _scope(path: str = "/v1/completions") -> dict:
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
            "server": ("localhost", 8000), "client": ("127.0.0.1", 5000),
            "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                        (b"transfer-encoding", b"chunked")]}


def _call(app, receive) -> tuple[int, dict]:
    sent = []

    async def send(msg):
        sent.append(msg)
    asyncio.run(app(_scope(), receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_body_limit_holds_while_reading_a_chunked_upload(text_model_dir):
    """An endless chunked body: reading stops one chunk past the limit (nothing more is held)."""
    app = build_app(_engine(text_model_dir), ServerConfig(max_request_bytes=100_000))
    pulled = 0

    async def receive():
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b" " * 16384, "more_body": True}
    status, body = _call(app, receive)
    assert status == 413 and "larger than 100000 bytes" in body["error"]["message"]
    assert pulled == 100_000 // 16384 + 1


def test_a_stalled_body_times_out(text_model_dir):
    app = build_app(_engine(text_model_dir), ServerConfig(request_body_timeout_s=0.3))

    async def receive():
        await asyncio.sleep(3600)
    t0 = time.monotonic()
    status, body = _call(app, receive)
    assert status == 408 and "did not arrive within 0.3 s" in body["error"]["message"]
    assert time.monotonic() - t0 < 5


# ---- streaming logprobs and the OpenAPI document -----------------------------------------------
def _events(c, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, content=json.dumps(body).encode(), headers=JSON) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streamed_logprobs_equal_the_non_streamed_ones(client):
    body = {"prompt": "hello world", "max_tokens": 10, "temperature": 0, "logprobs": 2,
            "stop": ["zz"]}
    full = _post(client, "/v1/completions", body).json()["choices"][0]["logprobs"]
    chunks = _events(client, "/v1/completions", body | {"stream": True})
    got = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs")}
    for ch in chunks:
        lp = ch["choices"][0]["logprobs"]
        assert lp is not None
        for k in got:
            got[k] += lp[k]
    assert got == {k: full[k] for k in got} and len(got["tokens"]) == 10

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    full = _post(client, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]
    content = []
    for ch in _events(client, "/v1/chat/completions", chat | {"stream": True})[1:]:
        content += (ch["choices"][0]["logprobs"] or {"content": []})["content"]
    assert content == full["content"] and len(content) == 8
    assert all(len(e["top_logprobs"]) >= 3 for e in content)


def test_openapi_shows_request_bodies_and_errors(client):
    doc = client.get("/openapi.json").json()
    for path, model, answer in (("/v1/completions", "CompletionRequest", "Completion"),
                                ("/v1/chat/completions", "ChatCompletionRequest",
                                 "ChatCompletion")):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert {"400", "413", "415", "500", "503"} <= set(op["responses"])
        props = doc["components"]["schemas"][model]["properties"]
        assert "temperature" in props
        # the limits the server enforces are in the document
        assert props["top_p"]["exclusiveMinimum"] == 0 and props["top_p"]["maximum"] == 1
        assert props["n"]["minimum"] == 1 and props["min_p"]["maximum"] == 1
        assert props["presence_penalty"]["minimum"] == -2
        assert props["max_tokens"]["anyOf"][0]["minimum"] == 0
        ok = op["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(ok)
        assert ok["application/json"]["schema"]["$ref"].endswith(f"/{answer}Response")
        data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
        assert data[0] == {"const": "[DONE]"}
        assert data[1]["contentSchema"]["anyOf"][0]["$ref"].endswith(f"/{answer}Chunk")
        assert {"const": 0} in props["temperature"]["anyOf"]         # 0, or at least 1e-5
    assert "ChatMessage" in doc["components"]["schemas"]          # nested models resolve


# ---- failures inside the engine -----------------------------------------------------------------
BAD_PROMPT = "hello world"


def _fail_bad_request(engine: LLMEngine, monkeypatch) -> None:
    """The request whose prompt is BAD_PROMPT fails in its update after two tokens."""
    bad_ids = engine.tokenizer.encode(BAD_PROMPT)
    real = type(engine)._append_tokens

    def append(self, req, tokens):
        if req.prompt_token_ids == bad_ids and len(req.output_token_ids) >= 2:
            raise RuntimeError("injected failure at /secret/path.py")
        return real(self, req, tokens)
    monkeypatch.setattr(type(engine), "_append_tokens", append)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_request_failing_in_the_engine_fails_alone_over_http(text_model_dir, monkeypatch):
    engine = _engine(text_model_dir)
    port = _free_port()
    innocent = [{"prompt": p, "max_tokens": 16, "temperature": t, "seed": 1, "ignore_eos": True}
                for p in ("def add(a, b):", "café", "return a", "x = 1") for t in (0, 0.9)]
    exit_code = []
    thread = threading.Thread(target=lambda: exit_code.append(
        serve(engine, ServerConfig(port=port), "error")), daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 20
    while True:
        try:
            httpx.get(base + "/health")
            break
        except httpx.TransportError:
            assert time.time() < deadline
            time.sleep(0.05)

    async def run_all(with_bad: bool):
        async with httpx.AsyncClient(base_url=base, timeout=60) as h:
            bad = {"prompt": BAD_PROMPT, "max_tokens": 16, "temperature": 0}
            jobs = [h.post("/v1/completions", json=b) for b in innocent]
            if with_bad:
                jobs += [h.post("/v1/completions", json=bad),
                         h.post("/v1/completions", json=bad | {"stream": True})]
            return await asyncio.gather(*jobs)
    reference = [r.json()["choices"][0]["text"] for r in asyncio.run(run_all(False))]
    _fail_bad_request(engine, monkeypatch)
    *good, bad, bad_stream = asyncio.run(run_all(True))
    assert [r.json()["choices"][0]["text"] for r in good] == reference
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "other requests are unaffected" in err["message"]
    assert "injected" not in bad.text and "/secret" not in bad.text
    events = [ln[6:] for ln in bad_stream.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert "injected" not in bad_stream.text
    assert httpx.get(base + "/health").status_code == 200
    m = httpx.get(base + "/metrics").text
    assert 'finished_reason="error"' in m

    # an engine-wide failure: 503 for the request in flight and every later one, /health says
    # why, and serve() returns 1 so that `specserve serve` exits non-zero
    def broken(batch):
        raise RuntimeError("injected target failure at /secret/path.py")
    monkeypatch.setattr(engine.runner, "execute", broken)
    r = httpx.post(base + "/v1/completions", json=innocent[0], timeout=30)
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
    assert "/secret" not in r.text
    thread.join(timeout=30)
    assert not thread.is_alive() and exit_code == [1]


def test_a_dead_engine_answers_503_at_once(text_model_dir, make_client, monkeypatch):
    engine = _engine(text_model_dir)
    c = make_client(engine)

    def broken(batch):
        raise RuntimeError("injected target failure at /secret/path.py")
    monkeypatch.setattr(engine.runner, "execute", broken)
    first = _post(c, "/v1/completions", GREEDY)
    assert first.status_code == 503
    t0 = time.monotonic()
    for path, body in (("/v1/completions", GREEDY),
                       ("/v1/completions", GREEDY | {"stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = _post(c, path, body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert time.monotonic() - t0 < 5
    h = c.get("/health")
    assert h.status_code == 503 and "RuntimeError" in h.json()["error"]["message"]
    assert 'specserve:engine_alive{model_name="tiny"} 0.0' in c.get("/metrics").text
    assert "/secret" not in h.text + first.text


def test_a_405_says_which_methods_are_allowed(client):
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert "method GET is not allowed" in r.json()["error"]["message"]
