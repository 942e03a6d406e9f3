"""The engine on a background thread, with one asyncio queue per request.

The step loop owns the LLMEngine: HTTP handlers never touch it directly but send commands
(add, abort) through a thread-safe queue that the loop drains between steps, so requests join
and leave between steps (continuous batching across all connections). Outputs go back to each
request's asyncio queue on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from specserve.engine.engine import LLMEngine
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger("specserve.server")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
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
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses; leaving early (client gone) aborts it."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", request_id, prompt, params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
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
            if cmd[0] == "add":
                _, rid, prompt, params = cmd
                if rid not in self._streams:        # the client left before it started
                    continue
                try:
                    self.engine.add_request(prompt, params, request_id=rid)
                except ValueError as e:
                    self._post(rid, e)
            else:
                self.engine.abort(cmd[1])

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
        except BaseException as e:          # report, fail every waiting client, stop
            logger.exception("engine loop failed")
            self.error = e
            for rid in list(self._streams):
                self._post(rid, RuntimeError(f"engine failed: {e}"))
