"""The engine on a background thread, with one asyncio queue per request.

The step loop owns the LLMEngine: HTTP handlers never touch it directly but send commands
(add, abort) through a thread-safe queue that the loop drains between steps, so requests join
and leave between steps (continuous batching across all connections). Outputs go back to each
request's asyncio queue on the server's event loop.

Failures: the engine aborts a request whose own work raises (its output then carries `error`)
and goes on; `generate` turns that into `RequestFailedError`. An exception out of `step()` is
engine-wide: the loop stops, every waiting and later request gets `EngineDeadError` at once,
and `on_fatal` runs (the CLI uses it to stop the server, which then exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from specserve.engine.engine import LLMEngine
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger("specserve.server")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The engine aborted this request alone after an internal error in its own work."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_fatal: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.engine.close()                   # tensor-parallel workers

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def why_dead(self) -> str:
        """What /health and 503 bodies say; no exception text (it may hold paths)."""
        if self.error is not None:
            return (f"the engine stopped after an internal error ({type(self.error).__name__}); "
                    "the server log has the details; restart the server")
        return "the engine loop is not running"

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses; leaving early (client gone) aborts it.
        Raises ValueError (bad request), RequestFailedError or EngineDeadError."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            # checked after registering: a loop that dies from now on posts to this stream
            if not self.alive:
                raise EngineDeadError(self.why_dead)
            self._commands.put(("add", request_id, prompt, params))
            self._wake.set()
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(f"request {request_id} failed inside the engine")
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.alive:
                self._commands.put(("abort", request_id))
                self._wake.set()

    def _post(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            rid = cmd[1]
            if cmd[0] == "add":
                if rid not in self._streams:        # the client left before it started
                    continue
                try:
                    self.engine.add_request(cmd[2], cmd[3], request_id=rid)
                except ValueError as e:             # the engine's message for bad input
                    self._post(rid, e)
                except Exception:                    # this request's fault, not the engine's
                    logger.exception("adding request %s failed", rid)
                    self._post(rid, RequestFailedError(f"request {rid} could not be added"))
            else:
                try:
                    self.engine.abort(rid)
                except Exception:
                    logger.exception("aborting request %s failed", rid)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._post(out.request_id, out)
        except BaseException as e:          # engine-wide: report, fail every client, stop
            logger.exception("engine loop failed; the server stops")
            self.error = e
            for rid in list(self._streams):
                self._post(rid, EngineDeadError(self.why_dead))
            if self.on_fatal is not None:
                self.on_fatal()
