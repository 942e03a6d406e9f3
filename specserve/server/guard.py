"""What every request passes before a route sees it: the Host header (against DNS rebinding),
the API key, and a JSON body read under a size limit and a deadline."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from urllib.parse import urlsplit

from fastapi import Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.server.protocol import error_body


class APIError(Exception):
    """A request error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.code), self.status)


class Gate:
    """ASGI middleware: Host header and API key checks before routing."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None, api_key: str | None,
                 open_paths: frozenset[str]) -> None:
        self.app, self.hosts, self.api_key, self.open_paths = app, hosts, api_key, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        if self.hosts is not None:
            try:
                name = urlsplit("//" + headers.get("host", "")).hostname or ""
            except ValueError:
                name = ""
            if name not in self.hosts:
                return APIError(400, "this server does not answer for the Host header "
                                f"{headers.get('host', '')!r}; start it with --allowed-hosts "
                                "to allow that name", code="invalid_host")
        if (self.api_key is not None and scope["path"] not in self.open_paths
                and scope["method"] != "OPTIONS"):          # CORS preflights carry no key
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(errors="replace"),
                                          f"Bearer {self.api_key}".encode()):
                return APIError(401, "missing or wrong API key: send 'Authorization: Bearer "
                                "<key>'", "authentication_error", "invalid_api_key")
        return None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number; send finite numbers only")


# No request of the API nests deeper (chat content parts sit at depth 5); deeper bodies would
# only cost recursion in validation and encoding.
MAX_JSON_DEPTH = 32


def _depth_exceeds(data: object, limit: int) -> bool:
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict)
                                                  else node))
    return False


async def read_json(request: Request, max_bytes: int, timeout_s: float) -> dict:
    """The request's JSON object body; APIError for anything else. The size limit holds while
    reading (a chunked upload stops at the limit) and the whole body must arrive in time."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, f"the body must be JSON sent with 'Content-Type: application/json', "
                       f"got {ctype or 'no Content-Type'!r}")
    too_large = APIError(413, f"the request body is larger than {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    body = b"".join(chunks)
    try:
        # strict UTF-8 first: json.loads(bytes) decodes with surrogatepass, which lets raw
        # surrogate bytes (\xed\xa0\x80) through as lone surrogates
        data = json.loads(body.decode("utf-8-sig"), parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 ({e.reason} at byte {e.start}); "
                       "send JSON as UTF-8 text") from None
    except ValueError as e:       # JSONDecodeError is a ValueError
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    if _depth_exceeds(data, MAX_JSON_DEPTH):        # whether parsing recursed that far or not
        raise APIError(400, "the body's JSON is nested too deeply")
    # "\ud800" is valid JSON but no text: the tokenizer and the reply would fail on it. Only an
    # escape brings one (raw surrogate bytes fail decoding), so most bodies skip the check.
    if not _SURROGATE_ESCAPE.search(body):
        return data
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply") from None
    except UnicodeEncodeError:
        raise APIError(400, "the body holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                       "\\udfff escape); send valid Unicode text") from None
    return data
