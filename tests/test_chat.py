"""`specserve chat` and `specserve pull` on SmolLM2: piped stdin (one message per line) and a
real terminal (a pty: streaming, Ctrl-C stops the answer and not the program, /exit)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from specserve.cli import main

CHAT = [sys.executable, "-m", "specserve.cli", "chat", "smollm2-135m-instruct", "--device", "cpu"]


def test_pull_prints_the_local_path_last(smollm2, capsys):
    main(["pull", "smollm2-135m-instruct"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(smollm2)
    main(["pull", "--list"])
    assert "smollm2-135m-instruct: HuggingFaceTB's SmolLM2-135M-Instruct" in capsys.readouterr().out


def test_unknown_catalogue_name_is_an_error(capsys):
    import pytest
    with pytest.raises(SystemExit, match="'smollm9' is not in the catalogue; available: smollm2"):
        main(["pull", "smollm9"])


def test_chat_on_piped_stdin(smollm2):
    done = subprocess.run(CHAT + ["--max-tokens", "16"], text=True, capture_output=True,
                          input="What is the capital of France?\n/reset\nSay hello.\n",
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout.splitlines()[0]
    status = [ln for ln in done.stderr.splitlines() if ln.startswith("[") and "tokens/s" in ln]
    assert len(status) == 2
    assert "[conversation forgotten]" in done.stderr


class Terminal:
    """What the chat wrote to its pty, read up to each marker in turn."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.pos = fd, b"", 0

    def expect(self, marker: bytes, timeout: float) -> bytes:
        end = time.monotonic() + timeout
        while (i := self.buf.find(marker, self.pos)) < 0:
            assert time.monotonic() < end, f"no {marker!r} in {self.buf[-800:]!r}"
            if select.select([self.fd], [], [], 0.5)[0]:
                self.buf += os.read(self.fd, 4096)
        seen, self.pos = self.buf[self.pos:i + len(marker)], i + len(marker)
        return seen


def test_chat_on_a_terminal_streams_and_ctrl_c_stops_the_answer(smollm2):
    pid, fd = pty.fork()
    if pid == 0:            # the child: the chat, on the pty
        os.execvp(CHAT[0], CHAT + ["--max-tokens", "400", "--temperature", "0.7",
                                   "--request-seed", "1"])
    term = Terminal(fd)
    try:
        term.expect(b"/reset forgets", 120)
        term.expect(b"> ", 60)
        os.write(fd, b"Write a long story about a dragon.\n")
        term.expect(b"dragon.\r\n", 10)         # the terminal's echo
        term.expect(b" ", 60)                   # the answer has started streaming
        os.write(fd, b"\x03")                   # Ctrl-C, through the terminal's line discipline
        assert b"tokens/s, stopped]" in term.expect(b"]", 60)
        term.expect(b"> ", 30)                  # still running: a new prompt
        os.write(fd, b"What is 2+2?\n")
        assert b"tokens/s]" in term.expect(b"]", 120)
        os.write(fd, b"/exit\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, term.buf
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.close(fd)
