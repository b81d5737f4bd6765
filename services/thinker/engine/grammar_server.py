"""The thinker's grammar compile server: `python -m omnistage.services.thinker.engine.grammar_server`.

A process of its own, started by grammar_compiles.py, talking over stdin/stdout in frames (a 4-byte
length, then a pickle; only the thinker writes to it). It loads xgrammar and the tokenizer's grammar
info once, then compiles each constraint in a child forked for it: a compile past its time is
killed (a thread could not be), its memory goes with it, and a cancelled compile is killed the same
way. At most `max_jobs` children compile at once; later jobs wait here in order.

In: {"tokenizer_info": json, "timeout_s": s, "max_jobs": n}, then ("compile", id, kind, text) and
("cancel", id). Out: ("ready", pid), then per job ("done", id, compiled json), ("refused", id,
message), ("timeout", id, s) or ("crashed", id, how).
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.services.thinker.engine.grammar import GrammarError, GrammarSpec, compile_spec

_HEADER = struct.Struct(">I")


class Frames:
    """Frames read from one file descriptor as its bytes come (select says when)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()
        self.closed = False

    def read(self) -> list[Any]:
        """The frames completed by one read; `closed` is set at end of file."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.closed = True
        self.buffer += chunk
        frames = []
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + size:
                break
            frames.append(pickle.loads(self.buffer[_HEADER.size : _HEADER.size + size]))
            del self.buffer[: _HEADER.size + size]
        return frames


def write_frame(fd: int, item: Any) -> None:
    data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass(eq=False)
class _Child:
    """One compile: its forked process, the pipe its answer comes through, its deadline."""

    job: str
    pid: int
    frames: Frames
    deadline: float
    answer: list[Any] = field(default_factory=list)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), however the parent died."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _compile_in_child(compiler: Any, kind: str, text: str, out: int) -> None:
    """The child's whole life: compile, write one frame, exit without the parent's clean-up."""
    try:
        _die_with_parent()
        try:
            answer: tuple = ("done", compile_spec(compiler, GrammarSpec(kind, text)).serialize_json())
        except GrammarError as exc:
            answer = ("refused", str(exc))
        write_frame(out, answer)
    finally:
        os._exit(0)


class Server:
    """The compile loop: jobs in from the thinker, one forked child each, answers back in order of
    completion."""

    def __init__(self, compiler: Any, timeout_s: float, max_jobs: int, inp: Frames, out: int) -> None:
        self.compiler, self.timeout_s, self.max_jobs = compiler, timeout_s, max_jobs
        self.inp, self.out = inp, out
        self.waiting: collections.deque[tuple[str, str, str]] = collections.deque()
        self.children: dict[str, _Child] = {}

    def run(self) -> None:
        while not self.inp.closed:
            self._start_waiting()
            now = time.monotonic()
            timeout = min((c.deadline - now for c in self.children.values()), default=None)
            fds = [self.inp.fd, *(c.frames.fd for c in self.children.values())]
            readable, _, _ = select.select(fds, [], [], None if timeout is None else max(0.0, timeout))
            if self.inp.fd in readable:
                for message in self.inp.read():
                    self.message(message)
            for child in list(self.children.values()):
                if child.frames.fd in readable:
                    child.answer += child.frames.read()
                    if child.frames.closed:
                        self._end(child, child.answer[0] if child.answer else None)
            now = time.monotonic()
            for child in [c for c in self.children.values() if c.deadline <= now]:
                self._kill(child)
                write_frame(self.out, ("timeout", child.job, self.timeout_s))
        for child in list(self.children.values()):  # the thinker is gone: so are its compiles
            self._kill(child)

    def message(self, message: tuple) -> None:
        if message[0] == "compile":
            self.waiting.append(message[1:])
        elif message[0] == "cancel":
            job = message[1]
            self.waiting = collections.deque(w for w in self.waiting if w[0] != job)
            if job in self.children:
                self._kill(self.children[job])

    def _start_waiting(self) -> None:
        while self.waiting and len(self.children) < self.max_jobs:
            job, kind, text = self.waiting.popleft()
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                _compile_in_child(self.compiler, kind, text, write)
            os.close(write)
            self.children[job] = _Child(job, pid, Frames(read), time.monotonic() + self.timeout_s)

    def _end(self, child: _Child, answer: tuple | None) -> None:
        self.children.pop(child.job)
        os.close(child.frames.fd)
        _, status = os.waitpid(child.pid, 0)
        if answer is None:
            how = (
                f"signal {os.WTERMSIG(status)}"
                if os.WIFSIGNALED(status)
                else f"exit {os.WEXITSTATUS(status)}"
            )
            write_frame(self.out, ("crashed", child.job, how))
        else:
            write_frame(self.out, (answer[0], child.job, answer[1]))

    def _kill(self, child: _Child) -> None:
        self.children.pop(child.job, None)
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)
        os.close(child.frames.fd)


def main() -> None:
    # It ends when the thinker does: its stdin closes. (Not by PR_SET_PDEATHSIG: that follows the
    # thread that started it, not the thinker process.) Ctrl-C is the thinker's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inp, out = Frames(sys.stdin.fileno()), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print never lands in the frames
    messages: list[Any] = []
    while not messages and not inp.closed:
        messages = inp.read()
    if not messages:
        return
    init = messages.pop(0)
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    write_frame(out, ("ready", os.getpid()))
    server = Server(compiler, init["timeout_s"], init["max_jobs"], inp, out)
    for message in messages:  # jobs that came with the init
        server.message(message)
    server.run()


if __name__ == "__main__":
    main()
