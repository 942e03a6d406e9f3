"""Server-sent events: one delta path for completions and chat, and the merge of several
prompts' streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from specserve.outputs import RequestOutput


@dataclass(slots=True)
class Delta:
    """What one chunk adds: text, and the tokens (with their logprobs) not sent before."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None


class DeltaTracker:
    """Turns a request's cumulative outputs into chunks. While the request runs, the last
    `holdback` characters stay back (a stop string may still cut them)."""

    def __init__(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0

    def next(self, out: RequestOutput) -> Delta | None:
        """The delta to send for `out`, or None when there is nothing to send yet."""
        comp = out.outputs[0]
        end = (len(comp.text) if out.finished
               else max(self.sent_chars, len(comp.text) - self.holdback))
        text = comp.text[self.sent_chars:end]
        if not text and not out.finished:
            return None
        self.sent_chars = end
        # logprobs cover the kept tokens (as in a non-streamed answer)
        n = len(comp.logprobs) if comp.logprobs is not None else len(comp.token_ids)
        toks = comp.token_ids[self.sent_tokens:n]
        lps = comp.logprobs[self.sent_tokens:n] if comp.logprobs is not None else None
        self.sent_tokens = max(self.sent_tokens, n)
        return Delta(text, toks, lps)


def sse(chunk: dict | str) -> str:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they arrive, tagged with their index."""
    if len(gens) == 1:              # the common case: no extra task and queue hop per step
        async with aclosing(gens[0]) as gen:
            async for out in gen:
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
