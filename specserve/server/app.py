"""FastAPI routes: OpenAI-compatible completions and chat (with SSE streaming), models, health,
Prometheus metrics. Every bad request gets a 4xx with an OpenAI error body; none stops the server.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from specserve.engine.engine import LLMEngine
from specserve.metrics import PrometheusMetrics
from specserve.outputs import RequestOutput
from specserve.server.async_engine import AsyncEngine
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest, error_body,
                                       new_id, now)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


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


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20) -> FastAPI:
    async_engine = AsyncEngine(engine)
    metrics = PrometheusMetrics(engine, served_model_name)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.code), status_code=e.status)

    @app.exception_handler(404)
    async def _not_found(req: Request, _e):
        return JSONResponse(error_body(f"no route {req.url.path}", "not_found_error"), 404)

    @app.exception_handler(405)
    async def _bad_method(req: Request, _e):
        return JSONResponse(error_body(f"method {req.method} is not allowed on {req.url.path}"),
                            405)

    def _auth(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", "invalid_api_key")

    async def _parse(request: Request, model: type[BaseModel]):
        _auth(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise APIError(413, f"request body is larger than {max_request_bytes} bytes")
        body = await request.body()
        if len(body) > max_request_bytes:
            raise APIError(413, f"request body is larger than {max_request_bytes} bytes")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise APIError(400, _validation_message(e)) from None
        if req.model is not None and req.model != served_model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                           f"'{served_model_name}'", code="model_not_found")
        return req

    def _prepare(prompt: str | list[int], req) -> tuple[list[int], int]:
        """Token ids and max_tokens, checked against the context length."""
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids as the prompt")
            ids = tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        limit = engine.max_model_len
        if not ids:
            raise APIError(400, "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {engine.vocab_size})")
        if len(ids) >= limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens, but this model's maximum "
                           f"context length is {limit} tokens; shorten the prompt")
        max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but "
                           f"{len(ids) + max_tokens} were requested ({len(ids)} in the prompt, "
                           f"{max_tokens} for the completion); lower max_tokens")
        return ids, max_tokens

    def _params(req, max_tokens: int, logprobs: int | None):
        try:
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def _run(ids: list[int], params, request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs and record its latency metrics."""
        timing = _Timing()
        last = None
        try:
            async for out in async_engine.generate(ids, params, request_id):
                timing.update(len(out.outputs[0].token_ids))
                last = out
                yield out
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            reason = (last.outputs[0].finish_reason if last is not None and last.finished
                      else "abort")
            metrics.observe_request(None if timing.first is None else timing.first - timing.start,
                                    timing.itls, time.monotonic() - timing.start, reason)

    async def _until_disconnect(request: Request, work: asyncio.Task):
        """Cancel a non-streaming request's work when its client goes away."""
        while not work.done():
            if await request.is_disconnected():
                work.cancel()
                return
            await asyncio.sleep(0.2)

    async def _collect(request: Request, gens: list[AsyncIterator[RequestOutput]]
                       ) -> list[RequestOutput]:
        async def last_of(gen):
            last = None
            async for out in gen:
                last = out
            return last
        work = asyncio.ensure_future(asyncio.gather(*(last_of(g) for g in gens)))
        watcher = asyncio.ensure_future(_until_disconnect(request, work))
        try:
            return await work
        finally:
            watcher.cancel()

    def _spec_metrics(out: RequestOutput) -> dict | None:
        s = out.spec_metrics
        if s is None:
            return None
        return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens,
                "accepted_per_position": s.num_accepted_tokens_per_pos,
                "acceptance_rate": s.acceptance_rate,
                "mean_acceptance_length": s.mean_acceptance_length}

    def _completion_logprobs(out: RequestOutput) -> dict | None:
        lps = out.outputs[0].logprobs
        if lps is None:
            return None
        toks = out.outputs[0].token_ids[:len(lps)]
        dec = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer else str
        return {"tokens": [dec(t) for t in toks],
                "token_logprobs": [lp[t] for t, lp in zip(toks, lps)],
                "top_logprobs": [{dec(k): v for k, v in lp.items()} for lp in lps],
                "text_offset": []}

    def _usage(outs: list[RequestOutput]) -> dict:
        p = sum(len(o.prompt_token_ids) for o in outs)
        c = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _holdback(req) -> int:
        """Characters kept back while streaming: a stop string may still cut them."""
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        return max((len(s) for s in stops), default=1) - 1

    async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.message, e.type, e.code))}\n\n"
        yield "data: [DONE]\n\n"

    async def _merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several requests' outputs as they arrive, tagged with their index."""
        if len(gens) == 1:              # the common case: no extra task and queue hop per step
            async for out in gens[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for out in gen:
                    await q.put((i, out))
                await q.put((i, None))
            except BaseException as e:       # hand errors to the consumer
                await q.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            remaining = len(gens)
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await _parse(request, CompletionRequest)
        prepared = [_prepare(p, req) for p in req.prompts()]
        rid, created = new_id("cmpl"), now()
        gens = [_run(ids, _params(req, mt, req.logprobs), f"{rid}-{i}")
                for i, (ids, mt) in enumerate(prepared)]
        if not req.stream:
            outs = await _collect(request, gens)
            choices = [{"index": i, "text": o.outputs[0].text, "logprobs": _completion_logprobs(o),
                        "finish_reason": o.outputs[0].finish_reason,
                        "stop_reason": o.outputs[0].stop_reason} for i, o in enumerate(outs)]
            body = {"id": rid, "object": "text_completion", "created": created,
                    "model": served_model_name, "choices": choices, "usage": _usage(outs)}
            if req.include_spec_metrics:
                body["spec_metrics"] = [_spec_metrics(o) for o in outs]
            return JSONResponse(body)

        async def chunks():
            sent = [0] * len(gens)
            finals: list[RequestOutput | None] = [None] * len(gens)
            hold = _holdback(req)
            async for i, out in _merge(gens):
                comp = out.outputs[0]
                end = len(comp.text) if out.finished else max(sent[i], len(comp.text) - hold)
                delta = comp.text[sent[i]:end]
                sent[i] = end
                if not delta and not out.finished:
                    continue
                chunk = {"id": rid, "object": "text_completion", "created": created,
                         "model": served_model_name,
                         "choices": [{"index": i, "text": delta, "logprobs": None,
                                      "finish_reason": comp.finish_reason}]}
                if out.finished:
                    finals[i] = out
                    if req.include_spec_metrics:
                        chunk["spec_metrics"] = _spec_metrics(out)
                yield chunk
            if req.stream_options and req.stream_options.include_usage:
                yield {"id": rid, "object": "text_completion", "created": created,
                       "model": served_model_name, "choices": [],
                       "usage": _usage([o for o in finals if o is not None])}
        return StreamingResponse(_sse(chunks()), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so chat is not available")
        try:
            prompt = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in req.messages])
        except ValueError as e:
            raise APIError(400, str(e)) from None
        ids, max_tokens = _prepare(prompt, req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, max_tokens, logprobs)
        rid, created = new_id("chatcmpl"), now()
        gen = _run(ids, params, rid)
        if not req.stream:
            (out,) = await _collect(request, [gen])
            comp = out.outputs[0]
            body = {"id": rid, "object": "chat.completion", "created": created,
                    "model": served_model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": comp.text},
                                 "logprobs": _chat_logprobs(out) if req.logprobs else None,
                                 "finish_reason": comp.finish_reason,
                                 "stop_reason": comp.stop_reason}],
                    "usage": _usage([out])}
            if req.include_spec_metrics:
                body["spec_metrics"] = _spec_metrics(out)
            return JSONResponse(body)

        def chunk(delta: dict, finish: str | None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": served_model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]}

        async def chunks():
            yield chunk({"role": "assistant", "content": ""}, None)
            sent, hold, final = 0, _holdback(req), None
            async for out in gen:
                comp = out.outputs[0]
                end = len(comp.text) if out.finished else max(sent, len(comp.text) - hold)
                delta, sent = comp.text[sent:end], end
                if delta or out.finished:
                    c = chunk({"content": delta} if delta else {}, comp.finish_reason)
                    if out.finished and req.include_spec_metrics:
                        c["spec_metrics"] = _spec_metrics(out)
                    yield c
                final = out
            if req.stream_options and req.stream_options.include_usage and final is not None:
                yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": served_model_name, "choices": [], "usage": _usage([final])}
        return StreamingResponse(_sse(chunks()), media_type="text/event-stream")

    def _chat_logprobs(out: RequestOutput) -> dict | None:
        lps = out.outputs[0].logprobs
        if lps is None:
            return None
        dec = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        content = []
        for t, lp in zip(out.outputs[0].token_ids, lps):
            s = dec(t)
            content.append({"token": s, "logprob": lp[t], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": dec(k), "logprob": v,
                                              "bytes": list(dec(k).encode())}
                                             for k, v in lp.items()]})
        return {"content": content}

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(request)
        return {"object": "list", "data": [{"id": served_model_name, "object": "model",
                                            "created": now(), "owned_by": "specserve",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            return JSONResponse(error_body("the engine loop has stopped", "server_error"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
