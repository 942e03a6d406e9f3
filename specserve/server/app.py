"""The OpenAI-compatible app: completions and chat (with SSE streaming), models, health,
Prometheus metrics. A bad request gets a 4xx with an OpenAI error body; a request that fails
inside the engine gets a 500 (or an error event in its stream) and no other request notices;
once the engine itself has stopped, every request gets a 503 at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from specserve.config import ServerConfig
from specserve.engine.engine import LLMEngine
from specserve.metrics import PrometheusMetrics
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server import responses
from specserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
)
from specserve.server.guard import APIError, Gate, read_json
from specserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    error_body,
    new_id,
    now,
)
from specserve.server.streaming import DeltaTracker, merge, sse

logger = logging.getLogger("specserve.server")

_ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "invalid request (the message says what and how to fix it)"),
    (401, "missing or wrong API key"), (404, "unknown model"),
    (408, "the body did not arrive in time"), (413, "the body is too large"),
    (415, "the body is not application/json"),
    (500, "the request failed inside the engine (other requests are unaffected)"),
    (503, "the engine has stopped"))}
_DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


@dataclass
class _Timing:
    """Latency bookkeeping of one request (for the Prometheus histograms)."""

    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    itls: list[float] = field(default_factory=list)

    def update(self, num_tokens: int) -> None:
        t = time.monotonic()
        new = num_tokens - self.num_tokens
        if new <= 0:
            return
        if self.first is None:
            self.first = t
            new -= 1          # the first token's wait is the TTFT, not an inter-token latency
        if new > 0 and self.last is not None:
            self.itls.extend([(t - self.last) / new] * new)
        self.last, self.num_tokens = t, num_tokens


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field '{loc}' (not part of this API)")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json_body(model: type[BaseModel], answer: type[BaseModel],
               chunk: type[BaseModel] | None = None) -> dict:
    """openapi_extra for a route that reads `model` as its JSON body itself and answers
    `answer`, or with "stream": true (`chunk` given) server-sent events of `chunk`s."""
    content: dict = {"application/json": {"schema": _ref(answer)}}
    if chunk is not None:
        # Open API 3.1 reads an event stream's schema as one event's; data is a chunk's JSON,
        # an error's (after the first event) or the last event's [DONE]
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}},
            "description": f"with \"stream\": true: one {chunk.__name__} per event, a final "
                           "usage chunk with stream_options.include_usage, then [DONE]"}}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(model)}}},
            "responses": {"200": {"description": "the answer", "content": content}}}


def _prompt_only(o: RequestOutput) -> RequestOutput:
    """`o` without the token it made (echo with max_tokens 0: the prompt alone is asked for)."""
    c = o.outputs[0]
    return dataclasses.replace(o, outputs=[dataclasses.replace(
        c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])])


def _best(outs: list[RequestOutput], n: int, keep_logprobs: bool) -> list[RequestOutput]:
    """best_of: the n samples whose tokens have the highest sum of log-probabilities."""
    def score(o: RequestOutput) -> float:
        c = o.outputs[0]
        return sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs or []))
    best = sorted(outs, key=score, reverse=True)[:n]
    if keep_logprobs:
        return best
    return [dataclasses.replace(o, outputs=[dataclasses.replace(o.outputs[0], logprobs=None)])
            for o in best]


class _ClosingStream(StreamingResponse):
    """Closes its body generator however the response ends: a client that hangs up leaves it
    suspended, and only closing it runs the finally blocks that abort the engine request."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class _Server:
    """The routes' shared state and helpers (one per app)."""

    def __init__(self, engine: LLMEngine, config: ServerConfig, async_engine: AsyncEngine
                 ) -> None:
        self.engine, self.config, self.async_engine = engine, config, async_engine
        self.name = config.served_model_name or engine.config.model_config.model
        self.metrics = PrometheusMetrics(engine, self.name, lambda: async_engine.alive)
        tok = engine.tokenizer
        self.decode: Callable[[int], str] = (
            (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str)
        self.max_prompt_tokens = (config.max_prompt_tokens_per_request
                                  or 8 * engine.max_model_len)
        self.max_body_tokens = config.max_tokens_per_request or 8 * engine.max_model_len

    async def parse(self, request: Request, model: type[BaseModel]):
        data = await read_json(request, self.config.max_request_bytes,
                               self.config.request_body_timeout_s)
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise APIError(400, _validation_message(e)) from None
        except RecursionError:
            raise APIError(400, "the body's JSON is nested too deeply") from None
        if req.model is not None and req.model != self.name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                           f"'{self.name}'", code="model_not_found")
        return req

    def prepare(self, prompts: list[str | list[int]], req) -> list[tuple[list[int], int]]:
        """Token ids and max_tokens of each prompt, checked against the request limits and the
        context length; the engine's own prompt checks give the messages."""
        if len(prompts) > self.config.max_prompts_per_request:
            raise APIError(400, f"the request has {len(prompts)} prompts; send at most "
                           f"{self.config.max_prompts_per_request} per request")
        limit = self.engine.max_model_len
        out, total, asked = [], 0, 0
        for prompt in prompts:
            try:
                ids = self.engine.prompt_ids(prompt)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            total += len(ids)
            if total > self.max_prompt_tokens:
                raise APIError(400, f"the request's prompts have more than "
                               f"{self.max_prompt_tokens} tokens in all; send fewer or shorter "
                               "prompts")
            max_tokens = req.max_tokens
            if max_tokens is None:
                max_tokens = min(self.config.default_max_tokens or limit, limit - len(ids))
            if len(ids) + max_tokens > limit:
                raise APIError(400, f"this model's maximum context length is {limit} tokens, "
                               f"but {len(ids) + max_tokens} were requested ({len(ids)} in the "
                               f"prompt, {max_tokens} for the completion); lower max_tokens")
            asked += max_tokens * req.samples_per_prompt()
            if asked > self.max_body_tokens:
                raise APIError(400, f"the request asks for more than {self.max_body_tokens} "
                               "tokens over its prompts (max_tokens x prompts x samples; the "
                               "server's --max-tokens-per-request); lower max_tokens or n, or "
                               "send fewer prompts")
            out.append((ids, max_tokens))
        return out

    def params(self, req, max_tokens: int, logprobs: int | None) -> SamplingParams:
        c = self.config
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        for what, items in (("stop strings", stops), ("stop_token_ids", req.stop_token_ids or [])):
            if len(items) > c.max_stop:
                raise APIError(400, f"the request gives {len(items)} {what}; at most "
                               f"{c.max_stop} are allowed (the server's --max-stop)")
        if any(len(s) > c.max_stop_chars for s in stops):
            raise APIError(400, f"a stop string is longer than {c.max_stop_chars} characters "
                           "(the server's --max-stop-chars); shorten it")
        try:
            params = req.sampling_params(max_tokens, logprobs)
            self.engine.check_params(params, "this server's")   # here, not in the engine loop
            return params
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def check_alive(self) -> None:
        if not self.async_engine.alive:
            raise APIError(503, self.async_engine.why_dead, "server_error", "engine_dead")

    async def run(self, ids: list[int], params: SamplingParams, request_id: str
                  ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs and record its latency metrics; engine errors become
        APIErrors whose text holds no internals (the log has them)."""
        timing = _Timing()
        reason = "abort"            # unless it finishes or fails
        try:
            async with aclosing(self.async_engine.generate(ids, params, request_id)) as outs:
                async for out in outs:
                    timing.update(len(out.outputs[0].token_ids))
                    reason = out.outputs[0].finish_reason or reason
                    yield out
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            reason = "error"
            raise APIError(503, str(e), "server_error", "engine_dead") from None
        except RequestFailedError:
            reason = "error"
            raise APIError(500, f"the request failed inside the engine (request id "
                           f"{request_id}); the server log has the details; other requests "
                           "are unaffected", "server_error") from None
        finally:
            self.metrics.observe_request(
                None if timing.first is None else timing.first - timing.start, timing.itls,
                time.monotonic() - timing.start, reason)

    async def collect(self, request: Request, gens: list[AsyncIterator[RequestOutput]]
                      ) -> list[RequestOutput]:
        """The final output of each request; their work is cancelled if the client leaves."""
        async def last_of(gen):
            last = None
            async with aclosing(gen):
                async for out in gen:
                    last = out
            return last
        work = asyncio.ensure_future(asyncio.gather(*(last_of(g) for g in gens)))

        async def until_disconnect():
            while not work.done():
                if await request.is_disconnected():
                    work.cancel()
                    return
                await asyncio.sleep(0.2)
        watcher = asyncio.ensure_future(until_disconnect())
        try:
            return await work
        finally:
            watcher.cancel()

    def stream(self, chunks) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield sse(chunk)
            except APIError as e:
                yield sse(error_body(e.message, e.type, e.code))
            except Exception:
                logger.exception("a stream failed")
                yield sse(error_body("internal error; the server log has the details",
                                     "server_error"))
            yield sse("[DONE]")
        return _ClosingStream(events(), media_type="text/event-stream")

    # ---- routes -----------------------------------------------------------------------------
    async def completions(self, request: Request):
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        prepared = self.prepare(req.prompts(), req)
        per_prompt = req.samples_per_prompt()
        # best_of > n ranks the samples by their tokens' log-probabilities: ask for them
        ranked = per_prompt > req.n
        logprobs = (req.logprobs or 0) if ranked else req.logprobs
        # samples per prompt: choice p * n + i is prompt p's sample i, as OpenAI orders them
        runs = [(ids, sample) for ids, mt in prepared
                for sample in self.params(req, max(mt, 1), logprobs).samples()]
        if req.echo and req.logprobs is not None:        # the prompt's own log-probabilities
            runs = [(ids, dataclasses.replace(p, prompt_logprobs=max(
                req.logprobs, req.prompt_logprobs or 0))) for ids, p in runs]
        self.check_alive()
        rid, created = new_id("cmpl"), now()
        gens = [self.run(ids, p, f"{rid}-{i}") for i, (ids, p) in enumerate(runs)]
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
        if not req.stream:
            outs = await self.collect(request, gens)
            if req.max_tokens == 0:          # echo of the prompt alone: the token made is dropped
                outs = [_prompt_only(o) for o in outs]
            counted = responses.usage(outs, per_prompt)
            if ranked:
                outs = [o for p in range(len(prepared))
                        for o in _best(outs[p * per_prompt:(p + 1) * per_prompt], req.n,
                                       keep_logprobs=req.logprobs is not None)]
            choices = self.with_prompt_logprobs(
                req, [self.completion_choice(i, o, req.echo) for i, o in enumerate(outs)], outs)
            body = head | {"choices": choices, "usage": counted}
            if req.include_spec_metrics:
                body["spec_metrics"] = [responses.spec_metrics(o) for o in outs]
            return JSONResponse(body)

        async def chunks():
            trackers = [DeltaTracker(req.stop) for _ in gens]
            echoed: set[int] = set()
            finals: dict[int, RequestOutput] = {}
            async with aclosing(merge(gens)) as outs:
                async for i, out in outs:
                    if req.max_tokens == 0:      # echo alone: sent once the prompt is scored
                        if not out.finished:
                            continue
                        out = _prompt_only(out)
                    d = trackers[i].next(out)
                    if d is None:
                        continue
                    text, ids, lps = d.text, d.token_ids, d.logprobs
                    if req.echo and i not in echoed:     # the prompt comes first, once
                        echoed.add(i)
                        text, ids, lps = self.with_prompt(out, text, ids, lps)
                    comp = out.outputs[0]
                    chunk = head | {"choices": [{
                        "index": i, "text": text, "finish_reason": comp.finish_reason,
                        "logprobs": responses.completion_logprobs(ids, lps, self.decode)}]}
                    if out.finished:
                        finals[i] = out
                        if req.include_spec_metrics:
                            chunk["spec_metrics"] = responses.spec_metrics(out)
                    yield chunk
            if req.stream_options and req.stream_options.include_usage:
                yield head | {"choices": [], "usage": responses.usage(
                    [finals[i] for i in sorted(finals)], per_prompt)}
        return self.stream(chunks())

    def with_prompt_logprobs(self, req, choices: list[dict], outs: list[RequestOutput]
                             ) -> list[dict]:
        """`choices` with vLLM's prompt_logprobs added when the request asked for them."""
        if req.prompt_logprobs is not None:
            for c, o in zip(choices, outs):
                c["prompt_logprobs"] = responses.prompt_logprobs(o, self.decode)
        return choices

    def with_prompt(self, o: RequestOutput, text: str, ids: list[int],
                    lps: list[dict[int, float]] | None):
        """`text`, `ids` and `lps` after the prompt's own (echo)."""
        tok = self.engine.tokenizer
        prompt = tok.decode(o.prompt_token_ids, skip_special_tokens=False) if tok else ""
        return (prompt + text, o.prompt_token_ids + ids,
                None if lps is None else (o.prompt_logprobs or []) + lps)

    def completion_choice(self, i: int, o: RequestOutput, echo: bool) -> dict:
        c = o.outputs[0]
        text, ids, lps = c.text, c.token_ids, c.logprobs
        if echo:
            text, ids, lps = self.with_prompt(o, text, ids, lps)
        return {"index": i, "text": text,
                "logprobs": responses.completion_logprobs(ids, lps, self.decode),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    async def chat_completions(self, request: Request):
        req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        try:
            prompt = self.engine.chat_prompt(
                [{"role": m.role, "content": m.text()} for m in req.messages])
        except ValueError as e:
            raise APIError(400, str(e)) from None
        ((ids, max_tokens),) = self.prepare([prompt], req)
        params = self.params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        self.check_alive()
        rid, created = new_id("chatcmpl"), now()
        gens = [self.run(ids, p, f"{rid}-{i}") for i, p in enumerate(params.samples())]
        if not req.stream:
            outs = await self.collect(request, gens)
            choices = self.with_prompt_logprobs(req, [
                {"index": i, "message": {"role": "assistant", "content": c.text},
                 "logprobs": responses.chat_logprobs(c.token_ids, c.logprobs, self.decode),
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for i, c in enumerate(o.outputs[0] for o in outs)], outs)
            body = {"id": rid, "object": "chat.completion", "created": created,
                    "model": self.name, "choices": choices,
                    "usage": responses.usage(outs, len(outs))}
            if req.include_spec_metrics:
                body["spec_metrics"] = [responses.spec_metrics(o) for o in outs]
            return JSONResponse(body)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.name}

        async def chunks():
            for i in range(len(gens)):
                yield head | {"choices": [{"index": i, "delta": {"role": "assistant",
                                                                 "content": ""},
                                           "logprobs": None, "finish_reason": None}]}
            trackers = [DeltaTracker(req.stop) for _ in gens]
            finals: list[RequestOutput] = []            # one prompt: their order is no matter
            async with aclosing(merge(gens)) as outs:
                async for i, out in outs:
                    d = trackers[i].next(out)
                    if d is None:
                        continue
                    c = head | {"choices": [{
                        "index": i, "delta": {"content": d.text} if d.text else {},
                        "logprobs": responses.chat_logprobs(d.token_ids, d.logprobs,
                                                            self.decode),
                        "finish_reason": out.outputs[0].finish_reason}]}
                    if out.finished:
                        finals.append(out)
                        if req.include_spec_metrics:
                            c["spec_metrics"] = responses.spec_metrics(out)
                    yield c
            if req.stream_options and req.stream_options.include_usage:
                yield head | {"choices": [], "usage": responses.usage(finals, len(finals))}
        return self.stream(chunks())

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": now(), "owned_by": "specserve",
                "max_model_len": self.engine.max_model_len}

    async def models(self):
        return {"object": "list", "data": [self.card()]}

    async def model(self, model_id: str):
        if model_id != self.name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves "
                           f"'{self.name}'", code="model_not_found")
        return self.card()

    async def version(self):
        return {"version": importlib.metadata.version("specserve")}

    async def tokenize(self, request: Request):
        req = await self.parse(request, TokenizeRequest)
        try:
            text = req.prompt if req.messages is None else self.engine.chat_prompt(
                [{"role": m.role, "content": m.text()} for m in req.messages],
                req.add_generation_prompt)
            ids = self.engine.prompt_ids(text)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, request: Request):
        req = await self.parse(request, DetokenizeRequest)
        bad = [t for t in req.tokens if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, "
                           f"{self.engine.vocab_size})")
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return {"prompt": self.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def health(self):
        if not self.async_engine.alive:
            return JSONResponse(error_body(self.async_engine.why_dead, "server_error",
                                           "engine_dead"), 503)
        return Response(status_code=200)

    async def prometheus(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")


def build_app(engine: LLMEngine, config: ServerConfig | None = None,
              on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """The app serving `engine`. `on_fatal` runs (on the engine thread) if the engine stops."""
    config = config or ServerConfig()
    async_engine = AsyncEngine(engine, on_fatal)
    s = _Server(engine, config, async_engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.add_exception_handler(APIError, lambda _r, e: e.response())
    app.add_exception_handler(404, lambda r, _e: JSONResponse(
        error_body(f"no route {r.url.path}", "not_found_error"), 404))
    app.add_exception_handler(405, lambda r, e: JSONResponse(
        error_body(f"method {r.method} is not allowed on {r.url.path}"), 405,
        headers=getattr(e, "headers", None)))       # Starlette's carries Allow

    def internal_error(_r: Request, e: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=e)
        return JSONResponse(error_body("internal error; the server log has the details",
                                       "server_error"), 500)
    app.add_exception_handler(Exception, internal_error)

    app.add_api_route("/v1/completions", s.completions, methods=["POST"], responses=_ERRORS,
                      openapi_extra=_json_body(CompletionRequest, CompletionResponse,
                                               CompletionChunk))
    app.add_api_route("/v1/chat/completions", s.chat_completions, methods=["POST"],
                      responses=_ERRORS, openapi_extra=_json_body(
                          ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk))
    app.add_api_route("/v1/models", s.models, methods=["GET"], response_model=ModelList)
    app.add_api_route("/v1/models/{model_id}", s.model, methods=["GET"], responses=_ERRORS,
                      response_model=ModelCard)
    app.add_api_route("/tokenize", s.tokenize, methods=["POST"], responses=_ERRORS,
                      openapi_extra=_json_body(TokenizeRequest, TokenizeResponse))
    app.add_api_route("/detokenize", s.detokenize, methods=["POST"], responses=_ERRORS,
                      openapi_extra=_json_body(DetokenizeRequest, DetokenizeResponse))
    app.add_api_route("/version", s.version, methods=["GET"], response_model=VersionResponse)
    app.add_api_route("/health", s.health, methods=["GET"], response_class=Response,
                      responses={200: {"description": "the engine runs (empty body)"},
                                 503: _ERRORS[503]})
    app.add_api_route("/health", s.health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", s.prometheus, methods=["GET"], response_class=Response,
                      responses={200: {"description": "Prometheus text format", "content": {
                          "text/plain": {"schema": {"type": "string"}}}}})

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                          DetokenizeRequest, CompletionResponse, ChatCompletionResponse,
                          CompletionChunk, ChatCompletionChunk, TokenizeResponse,
                          DetokenizeResponse, ErrorResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(js.pop("$defs", {}))
                schemas[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi

    open_paths = {"/health"} | ({"/metrics", *_DOC_PATHS} if config.public_metrics else set())
    if config.origins():
        app.add_middleware(CORSMiddleware, allow_origins=config.origins(),
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    # added last = runs first: a wrong Host or key is refused before anything else
    app.add_middleware(Gate, hosts=config.host_names(), api_key=config.api_key,
                       open_paths=frozenset(open_paths))
    return app
