"""The thinker's constraint compiles (grammar_compiles.py, grammar_server.py): a compile past its time
is killed and refused (and refused again at once), one a caller left is killed and frees its slot,
requests waiting for the same text share one compile, too many waiting are RESOURCE_EXHAUSTED, a
dead compile server fails its jobs and the next request starts another."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from omnistage.common.runtime.errors import InvalidRequest, Overloaded, StageUnavailable
from omnistage.services.thinker.engine.grammar import GrammarSpec
from omnistage.services.thinker.engine.grammar_compiles import (
    GrammarCompiles,
    GrammarLimits,
    server_at_startup,
)
from omnistage.services.thinker.models.tokenizer import MingTokenizer

# One level deep, and minutes to compile (29 s at {1,3000} on the tiny vocabulary): only a
# time bound stops it.
SLOW = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "^(ab|cd|ef){1,6000}$"}))
FAST = GrammarSpec("ebnf", 'root ::= "yes" | "no"')


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> MingTokenizer:
    return MingTokenizer(tiny_ckpt)


def run(tok, scenario, **limits):
    async def main():
        compiles = GrammarCompiles(tok, asyncio.get_running_loop(), GrammarLimits(**limits))
        await asyncio.get_running_loop().run_in_executor(None, compiles.start)
        try:
            return await scenario(compiles)
        finally:
            compiles.close()

    return asyncio.run(main())


def test_a_compile_past_its_time_is_refused_and_the_same_text_again_at_once(tok):
    async def scenario(compiles):
        with pytest.raises(InvalidRequest) as first:
            await compiles.get(SLOW)
        assert SLOW in compiles.refused and not compiles._jobs
        with pytest.raises(InvalidRequest) as again:
            await compiles.get(SLOW)
        return str(first.value), str(again.value)

    first, again = run(tok, scenario, timeout_s=1.0)
    assert first == again
    assert first.startswith("sampling.constraint.json_schema: did not compile within 1 s")
    assert "engine.grammar_compile_timeout_s" in first


def test_a_compile_its_caller_left_is_killed_and_frees_its_slot(tok):
    """One compile at a time, each bounded at 10 minutes: the next one is answered only if the
    abandoned one was killed."""

    async def scenario(compiles):
        left = asyncio.ensure_future(compiles.get(SLOW))
        await asyncio.sleep(0.5)
        left.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await left
        assert not compiles._jobs, "nobody waits for it: forgotten"
        grammar = await asyncio.wait_for(compiles.get(FAST), 120)
        return grammar.spec

    assert run(tok, scenario, timeout_s=600.0, max_compiles=1) == FAST


def test_waiters_for_one_text_share_its_compile_and_its_result_is_cached(tok):
    async def scenario(compiles):
        both = asyncio.gather(compiles.get(FAST), compiles.get(FAST))
        await asyncio.sleep(0)
        shared = len(compiles._jobs)
        first, second = await both
        return shared, first is second, await compiles.get(FAST) is first

    assert run(tok, scenario) == (1, True, True)


def test_compiles_beyond_the_running_and_waiting_ones_are_resource_exhausted(tok):
    async def scenario(compiles):
        running = asyncio.ensure_future(compiles.get(SLOW))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as full:
            await compiles.get(FAST)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        return full.value

    full = run(tok, scenario, timeout_s=600.0, max_compiles=1, max_waiting=0)
    assert "engine.grammar_compiles 1" in str(full) and full.retry_after_ms == 600_000


def test_a_dead_compile_server_fails_its_jobs_and_the_next_request_starts_another(tok):
    async def scenario(compiles):
        waiting = asyncio.ensure_future(compiles.get(SLOW))
        await asyncio.sleep(0.5)
        first = compiles.server
        first.proc.kill()
        with pytest.raises(StageUnavailable) as lost:
            await waiting
        grammar = await compiles.get(FAST)
        return lost.value, compiles.server is not first and compiles.server is not None, grammar.spec

    lost, restarted, spec = run(tok, scenario, timeout_s=600.0)
    assert str(lost).startswith("thinker: the grammar compile server exited") and lost.retryable
    assert restarted and spec == FAST


def test_the_server_starts_at_start_up_on_cuda_and_at_first_use_on_a_plain_cpu_unless_set():
    """engine.grammar_server: auto follows the device; startup and first_use are what they say."""
    assert server_at_startup("auto", on_cuda=True) and not server_at_startup("auto", on_cuda=False)
    assert server_at_startup("startup", on_cuda=False) and server_at_startup("startup", on_cuda=True)
    assert not server_at_startup("first_use", on_cuda=True) and not server_at_startup(
        "first_use", on_cuda=False
    )
