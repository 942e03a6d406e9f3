"""`specserve chat MODEL`: a conversation in the terminal through the model's chat template
(the engine's `chat_prompt`, which LLM.chat and the server use too).

Answers stream as they are decoded; after each one a status line gives its tokens/s and, when
speculating, the mean acceptance length. `/reset` forgets the conversation, `/exit` (or Ctrl-D)
leaves; Ctrl-C stops the answer, not the program. Lines pasted together are one message. With
piped stdin each line is one message.
"""

from __future__ import annotations

import contextlib
import select
import signal
import sys
import threading
import time
from typing import TextIO

from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams

HELP = "/reset forgets the conversation, /exit leaves; Ctrl-C stops an answer"
PASTE_WAIT_S = 0.05         # lines arriving closer together than this were pasted as one


def read_message(stdin: TextIO, interactive: bool, out: TextIO) -> str | None:
    """The user's next message; None at the end of input."""
    if interactive:
        out.write("\n> ")
        out.flush()
    line = stdin.readline()
    if not line:
        return None
    lines = [line]
    while interactive and _more_waiting(stdin):
        more = stdin.readline()
        if not more:
            break
        lines.append(more)
    return "".join(lines).rstrip("\n")


def _more_waiting(stdin: TextIO) -> bool:
    try:
        return bool(select.select([stdin], [], [], PASTE_WAIT_S)[0])
    except (ValueError, OSError):       # not a selectable file
        return False


@contextlib.contextmanager
def _stop_on_ctrl_c():
    """An Event that Ctrl-C sets while the block runs (in the main thread). A KeyboardInterrupt
    would be lost when it is raised inside a finalizer or a garbage collector callback, which
    print and swallow it: under load the answer then ran on."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def answer(engine: LLMEngine, messages: list[dict], params: SamplingParams,
           out: TextIO) -> tuple[str, str]:
    """Stream the reply to `messages`; returns its text and the status line. Ctrl-C aborts
    the request after the step under way and keeps what was written."""
    rid = engine.add_request(engine.chat_prompt(messages), params)
    t0 = time.perf_counter()
    text, last = "", None
    with _stop_on_ctrl_c() as stop:
        while engine.has_unfinished_requests() and not stop.is_set():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                last = o
                delta = o.outputs[0].text[len(text):]
                text = o.outputs[0].text
                out.write(delta)
                out.flush()
    interrupted = stop.is_set() and (last is None or not last.finished)
    if interrupted:
        engine.abort(rid)
    dt = time.perf_counter() - t0
    n = len(last.outputs[0].token_ids) if last is not None else 0
    status = f"[{n} tokens, {n / dt:.1f} tokens/s"
    if last is not None and last.spec_metrics is not None and last.spec_metrics.num_drafts:
        status += f", mean acceptance length {last.spec_metrics.mean_acceptance_length:.2f}"
    status += ", stopped]" if interrupted else "]"
    return text, status


def run_chat(engine: LLMEngine, params: SamplingParams, stdin: TextIO = sys.stdin,
             out: TextIO = sys.stdout, err: TextIO = sys.stderr,
             system: str | None = None) -> None:
    interactive = stdin.isatty()
    engine.chat_prompt([{"role": "user", "content": ""}])      # no template: fail before asking
    if interactive:
        err.write(f"specserve chat: {HELP}\n")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        try:
            msg = read_message(stdin, interactive, out)
        except KeyboardInterrupt:       # at the prompt: a fresh line, as a shell does
            out.write("\n")
            continue
        if msg is None or msg.strip() == "/exit":
            break
        if msg.strip() == "/reset":
            messages = list(start)
            err.write("[conversation forgotten]\n")
            continue
        if not msg.strip():
            continue
        messages.append({"role": "user", "content": msg})
        reply, status = answer(engine, messages, params, out)
        messages.append({"role": "assistant", "content": reply})
        out.write("\n")
        out.flush()
        err.write(status + "\n")
        err.flush()
