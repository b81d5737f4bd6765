"""The thinker's compiles of clients' constraints: cached by text, shared by the requests waiting for
the same one, run in the compile server (grammar_server.py, a process of its own: a compile past its
time is killed, never left burning a thread) and abandoned when nobody waits for them any more.

Why a process: a compile cannot be interrupted, and some schemas take minutes and hundreds of MB
(a 1000-deep one). In a thread it would hold a core and its memory to the end, whatever the bound;
in the server it is killed at `timeout_s`. Tokenization never waits behind a compile: they share
no pool. The tokenizer's grammar info (seconds of Python on a real vocabulary, holding the GIL) is
built once, at start-up; the server starts then too (it loads xgrammar, seconds, in parallel).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import InvalidRequest, Overloaded, StageUnavailable
from omnistage.services.thinker.engine.grammar import Grammar, GrammarSpec, TokenBytes, tokenizer_info, xgr
from omnistage.services.thinker.engine.grammar_server import Frames, write_frame

_log = logging.getLogger(__name__)
# Refusals remembered by text, so the same slow schema is not compiled (and killed) again.
_REFUSALS_KEPT = 1024
# What a request waits for the server to load xgrammar, beyond its compile's own bound.
_SERVER_START_S = 120.0


def server_at_startup(mode: str, on_cuda: bool) -> bool:
    """Whether rank 0 starts the compile server (and builds the tokenizer's grammar info) at start-up
    (engine.grammar_server); otherwise the first constrained request starts them and waits for them.
    `auto` starts it at start-up on CUDA. On a plain CPU the stages share its cores: the server's
    imports (xgrammar brings torch and transformers, ~2 s of CPU and ~270 MB) would take them from the
    other stages' start-up, for a feature a CPU deployment may never be asked for."""
    return mode == "startup" or (mode == "auto" and on_cuda)


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds of constraint compiles (the deploy file's engine.grammar_* keys)."""

    timeout_s: float = 5.0  # one compile's time; past it, INVALID_ARGUMENT (and the compile killed)
    max_compiles: int = 2  # compiles at once (cores they may take)
    max_waiting: int = 16  # compiles waiting for one of those; more: RESOURCE_EXHAUSTED
    cache_bytes: int = 256 << 20  # compiled grammars kept (least recently used dropped first)


@dataclass(eq=False)
class _Job:
    id: str
    spec: GrammarSpec
    done: asyncio.Future
    waiters: int = 0


class CompileServer:
    """One grammar_server process: jobs written to its stdin, answers read by a thread of our own
    (which also deserializes a compiled grammar: xgrammar releases the GIL for it)."""

    def __init__(self, info: Any, limits: GrammarLimits, on_answer, on_exit) -> None:
        self.info = info
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.services.thinker.engine.grammar_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._lock = threading.Lock()
        self.send(
            {
                "tokenizer_info": info.serialize_json(),
                "timeout_s": limits.timeout_s,
                "max_jobs": limits.max_compiles,
            }
        )
        self._on_answer, self._on_exit = on_answer, on_exit
        threading.Thread(target=self._read, name="grammar-server", daemon=True).start()

    def send(self, message: Any) -> None:
        with self._lock:
            try:
                write_frame(self.proc.stdin.fileno(), message)
            except OSError:  # it died: the reader reports it
                pass

    def close(self) -> None:
        """End of its stdin: it kills its compiles and exits; killed if it does not within 5 s."""
        with self._lock:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        frames = Frames(self.proc.stdout.fileno())
        while not frames.closed:
            for answer in frames.read():
                if answer[0] == "done":
                    answer = self._grammar(answer)
                if answer[0] != "ready":
                    self._on_answer(answer)
        self._on_exit(self, self.proc.wait())

    def _grammar(self, answer: tuple) -> tuple:
        try:
            return ("done", answer[1], xgr().CompiledGrammar.deserialize_json(answer[2], self.info))
        except (RuntimeError, ValueError) as exc:
            return ("crashed", answer[1], f"its result did not load: {exc}")


class GrammarCompiles:
    """`await get(spec)` → the compiled Grammar, or InvalidRequest naming `sampling.constraint.<kind>`
    (does not compile, or not within the time bound), Overloaded when too many compiles wait."""

    def __init__(self, tokenizer: TokenBytes, loop: asyncio.AbstractEventLoop, limits: GrammarLimits) -> None:
        self.tokenizer, self.loop, self.limits = tokenizer, loop, limits
        self.info: Any = None
        self.server: CompileServer | None = None
        self.cache: collections.OrderedDict[GrammarSpec, Grammar] = collections.OrderedDict()
        self.cache_bytes = 0
        self.refused: collections.OrderedDict[GrammarSpec, str] = collections.OrderedDict()
        self._jobs: dict[GrammarSpec, _Job] = {}
        self._by_id: dict[str, _Job] = {}
        self._ids = itertools.count()
        self._start_lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Build the tokenizer's grammar info and start the server (blocking: the warm-up's thread)."""
        with self._start_lock:
            if self.info is None:
                self.info = tokenizer_info(self.tokenizer)
            if self.server is None and not self._closed:
                self.server = CompileServer(self.info, self.limits, self._answer_soon, self._exit_soon)

    def close(self) -> None:
        with self._start_lock:
            self._closed = True
            server, self.server = self.server, None
        if server is not None:
            server.close()

    @property
    def wait_limit_s(self) -> float:
        """The longest a request waits for its grammar: its compile behind every one that may wait
        before it, and the server's start."""
        rounds = math.ceil((self.limits.max_waiting + 1) / self.limits.max_compiles)
        return rounds * self.limits.timeout_s + _SERVER_START_S

    async def get(self, spec: GrammarSpec) -> Grammar:
        cached = self.cache.get(spec)
        if cached is not None:
            self.cache.move_to_end(spec)
            return cached
        if spec in self.refused:
            raise InvalidRequest(self.refused[spec])
        if self.server is None:
            await self.loop.run_in_executor(None, self.start)
        job = self._jobs.get(spec) or self._submit(spec)
        job.waiters += 1
        try:
            return await within(asyncio.shield(job.done), self.wait_limit_s)
        except TimeoutError:
            raise StageUnavailable(
                f"thinker: the grammar compile server gave no answer in {self.wait_limit_s:.0f} s"
            ) from None
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.done.done():  # nobody waits for it any more
                self._forget(job)
                if self.server is not None:
                    self.server.send(("cancel", job.id))

    def _submit(self, spec: GrammarSpec) -> _Job:
        limits = self.limits
        if len(self._jobs) >= limits.max_compiles + limits.max_waiting:
            raise Overloaded(
                f"thinker: {len(self._jobs)} grammar compiles running or waiting "
                f"(engine.grammar_compiles {limits.max_compiles} + engine.grammar_waiting {limits.max_waiting})",
                retry_after_ms=int(limits.timeout_s * 1000),
                reason="grammar_compiles",
            )
        job = _Job(str(next(self._ids)), spec, self.loop.create_future())
        self._jobs[spec], self._by_id[job.id] = job, job
        assert self.server is not None
        self.server.send(("compile", job.id, spec.kind, spec.text))
        return job

    def _forget(self, job: _Job) -> None:
        self._by_id.pop(job.id, None)
        if self._jobs.get(job.spec) is job:
            del self._jobs[job.spec]

    def _answer_soon(self, answer: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the thinker is stopping
            self.loop.call_soon_threadsafe(self._answer, answer)

    def _exit_soon(self, server: CompileServer, returncode: int) -> None:
        if not self._closed:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._exited, server, returncode)

    def _answer(self, answer: tuple) -> None:
        """On the event loop: finish the job (nothing when it was abandoned)."""
        kind, job_id, payload = answer
        job = self._by_id.get(job_id)
        if job is None:
            return
        self._forget(job)
        where = f"sampling.constraint.{job.spec.kind}"
        if kind == "done":
            grammar = Grammar(job.spec, payload, self.tokenizer.vocab_size)
            self._keep(grammar)
            job.done.set_result(grammar)
            return
        if kind == "refused":
            why = payload
        elif kind == "timeout":
            why = (
                f"{where}: did not compile within {self.limits.timeout_s:g} s "
                "(engine.grammar_compile_timeout_s); a smaller or shallower schema compiles faster"
            )
        else:
            why = f"{where}: the grammar compiler failed on it ({payload})"
            _log.warning("grammar compile failed: %s", why)
        self.refused[job.spec] = why
        while len(self.refused) > _REFUSALS_KEPT:
            self.refused.popitem(last=False)
        job.done.set_exception(InvalidRequest(why))
        job.done.exception()  # retrieved: its waiters may all have left meanwhile

    def _exited(self, server: CompileServer, returncode: int) -> None:
        """The server is gone: its jobs fail (UNAVAILABLE, retryable); the next request starts another."""
        if self._closed or server is not self.server:
            return
        self.server = None
        _log.error(
            "the grammar compile server exited (code %s); the next constrained request restarts it",
            returncode,
        )
        for job in list(self._by_id.values()):
            self._forget(job)
            job.done.set_exception(
                StageUnavailable(f"thinker: the grammar compile server exited (code {returncode})")
            )
            job.done.exception()

    def _keep(self, grammar: Grammar) -> None:
        size = grammar.compiled.memory_size_bytes
        self.cache[grammar.spec] = grammar
        self.cache_bytes += size
        while self.cache_bytes > self.limits.cache_bytes and len(self.cache) > 1:
            _, dropped = self.cache.popitem(last=False)
            self.cache_bytes -= dropped.compiled.memory_size_bytes
