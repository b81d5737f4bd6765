"""ThinkerEngine: the thinker's request flow — bound, tokenize, submit, stream outputs, end the request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, fields, replace

from omnistage.common.context_rule import check_context
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop, DeviceStopped
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.common.sampling import check_sampling
from omnistage.common.transport import TransportContext, encode
from omnistage.services.thinker.engine.budget import RequestBudget, RequestError
from omnistage.services.thinker.engine.grammar import GrammarSpec
from omnistage.services.thinker.engine.grammar_compiles import GrammarCompiles, GrammarLimits
from omnistage.services.thinker.engine.llm_engine import LLMEngine, RequestOutput
from omnistage.services.thinker.engine.media import Prompt, unpack_prompt
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.models.tokenizer import MingTokenizer, Piece
from omnistage.services.thinker.multimodal import MediaInputs, release_refs
from omnistage.services.thinker.runner import Arrival, Stream, ThinkerRunner
from omnistage.services.thinker.tp.distributed import TPError
from omnistage.v1 import common_pb2, tensor_pb2, thinker_pb2

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Started:
    """First of every stream: the engine's id of the request and its prompt's length in tokens."""

    engine_request_id: str
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Tokens:
    """New tokens (and their text, logprobs) of one step."""

    out: RequestOutput


@dataclass(frozen=True)
class Hidden:
    """Hidden-state mode: the query block's rows, leased to the caller."""

    ref: tensor_pb2.TensorRef


@dataclass(frozen=True)
class Finished:
    """Last of a stream that ran to its end: the finish reason and usage."""

    out: RequestOutput


Event = Started | Tokens | Hidden | Finished


# SamplingParams' fields that the proto field of the same name gives as it is (the rules of
# `common/sampling.py` read both by these names); seed is optional on the wire, the lists become
# tuples, and the grammar is compiled from the constraint later.
_AS_ON_THE_WIRE = tuple(
    f.name for f in fields(SamplingParams) if f.name not in ("seed", "stop", "stop_token_ids", "grammar")
)


def sampling_from_proto(s: common_pb2.SamplingParams, vocab_size: int, max_model_len: int) -> SamplingParams:
    """The shared rules (`common/sampling.py`) give the INVALID_ARGUMENT message; zero means "off"."""
    check_sampling(s, max_model_len=max_model_len, vocab_size=vocab_size)
    return SamplingParams(
        **{name: getattr(s, name) for name in _AS_ON_THE_WIRE},
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
    )


def grammar_spec(s: common_pb2.SamplingParams) -> GrammarSpec | None:
    """The constraint of a (checked) proto, or None."""
    if not s.HasField("constraint"):
        return None
    kind = s.constraint.WhichOneof("kind")
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(s.constraint, kind))


async def next_output(stream: Stream, held: list[BaseException]) -> RequestOutput | BaseException:
    """The request's next output. Those that queued while its caller was busy come as one, their
    tokens, text and logprobs joined: a consumer behind the engine (a gateway busy with many streams)
    gets fewer, larger events instead of falling further behind. An error after them waits in `held`
    for the next call; a final or hidden-state output is never joined past."""
    out = held.pop() if held else await stream.get()
    while (
        isinstance(out, RequestOutput)
        and not out.finished
        and out.hidden_states is None
        and not stream.empty()
    ):
        more = stream.get_nowait()
        if isinstance(more, BaseException):
            held.append(more)
            break
        out = replace(
            more,
            token_ids=out.token_ids + more.token_ids,
            text=out.text + more.text,
            logprobs=out.logprobs + more.logprobs,
        )
    return out


def logprob_token_bytes(flow: ThinkerEngine, keep_special: bool) -> Callable[[int], bytes]:
    """A token's bytes as its logprobs show them. A special token's are empty where the answer's text
    leaves special tokens out, so the chosen tokens' bytes still join to the text (as vLLM's logprobs
    with skip_special_tokens)."""
    token_bytes, special = flow.tokenizer.token_bytes, flow._special_ids
    if keep_special:
        return token_bytes
    return lambda token_id: b"" if token_id in special else token_bytes(token_id)


def in_vocabulary(where: str, ids: Sequence[int], vocab: int) -> list[int]:
    """`ids` as a list, each inside the vocabulary, else INVALID_ARGUMENT naming `where`."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{where}: {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return list(ids)


def prompt_piece(i: int, p: thinker_pb2.PromptPiece, vocab: int, special: frozenset[int]) -> Piece:
    """A chat piece for the tokenizer: a client's token ids are text tokens only (never control
    tokens); template ids and text as they are."""
    kind = p.WhichOneof("piece")
    if kind == "tokens":
        return ("tokens", in_vocabulary(f"chat.pieces[{i}].tokens", p.tokens.ids, vocab))
    if kind == "client_tokens":
        where = f"chat.pieces[{i}].client_tokens"
        ids = in_vocabulary(where, p.client_tokens.ids, vocab)
        bad = next((t for t in ids if t in special), None)
        if bad is not None:
            raise InvalidRequest(f"{where}: {bad} is a special token (a client's ids are text tokens only)")
        return ("tokens", ids)
    return ("template", p.template) if kind == "template" else ("text", p.text)


class ThinkerEngine:
    """`generate(request)` → Started, then Tokens / Hidden, then Finished. Owns the device loop."""

    def __init__(
        self,
        engine: LLMEngine,
        events: asyncio.AbstractEventLoop,
        *,
        tokenize_workers: int = 2,
        media: MediaInputs | None = None,
        producer: TransportContext | None = None,
        idle_wait_s: float = 0.5,
        grammars: GrammarCompiles | None = None,
    ) -> None:
        self.runner = ThinkerRunner(engine, events, gather_s=engine.cfg.gather_arrivals_ms / 1000.0)
        # A failure's message is the group's own (`rank 2 died while ...`); a TPError says it all.
        self.loop = DeviceLoop(
            "engine", self.runner, idle_wait_s=idle_wait_s, describe_failure=str, quiet_failures=(TPError,)
        )
        self.runner.arrivals.wake = self.loop.wake  # the last one on its way came (or was refused)
        self.media = media  # None: this thinker takes no embeddings (FAILED_PRECONDITION)
        # Where hidden states leave (hidden-state mode); None, or no query rows: the mode is refused.
        self.producer = producer
        # Leases of refused requests are released through this (the media's transport, if any).
        self._transport = media.transport if media is not None else None
        self.tokenizer: MingTokenizer = engine.tokenizer
        # Admission, as every stage's: a request holds one of max_num_seqs + max_queued_requests
        # places from its submit to its end; past them RESOURCE_EXHAUSTED at once (the engine's
        # waiting list is the waiting room, so the limiter keeps none of its own).
        self.admission = ConcurrencyLimiter(
            "thinker engine",
            engine.cfg.max_num_seqs + engine.cfg.max_queued_requests,
            max_waiting=0,
            waiting_key="engine.max_num_seqs + engine.max_queued_requests",
        )
        self.max_model_len = engine.cfg.max_model_len  # the engine's context: what every budget fits
        self.default_max_tokens = engine.cfg.default_max_tokens
        # A client's token ids may be none of these (client input never becomes control tokens).
        self._special_ids = frozenset(self.tokenizer.special_tokens.values())
        self._pool = concurrent.futures.ThreadPoolExecutor(tokenize_workers, "tokenize")
        # Structured outputs: constraints compiled in a process of their own (never in the tokenize
        # pool), bounded in time, cached by text; started at the first one unless started already.
        self.grammars = grammars or GrammarCompiles(self.tokenizer, events, GrammarLimits())

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        """Stop the device loop (after the servicer has drained): open streams end with DeviceStopped."""
        self.loop.stop()

    def close(self) -> None:
        """Stop the tokenize pool (tokenizations under way finish in their threads, unawaited) and
        the grammar compile server."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()
        if self._transport is not None and self.media is None:
            self._transport.close()

    def load(self) -> tuple[int, int]:
        return self.runner.load()

    async def generate(
        self, request: thinker_pb2.ThinkerRequest, deadline: float = math.inf
    ) -> AsyncIterator[Event]:
        """The request's events. `deadline`: time.monotonic() of the caller's deadline (inf: none).
        Close the iterator (`contextlib.aclosing`) when leaving early: that aborts the engine
        request and takes back a hidden-state ref not yet handed on. A never-possible request is
        refused (INVALID_ARGUMENT) before a full engine says "not now". From here to its add the
        request is on its way (the runner's `arrivals`): an idle engine's first step waits for it."""
        with self.runner.arrivals.coming() as arrival:
            prompt, params, budget = await self._admit(request)
            async with self.admission.admit(deadline, 1.0, what="a place in the engine", retry_after_ms=200):
                engine_id = uuid.uuid4().hex
                finished = False
                try:
                    # Inside the try: a cancel while the add is in flight still aborts what it added.
                    stream = await self._submit(engine_id, prompt, params, budget, arrival)
                    yield Started(engine_id, budget.prompt_tokens)
                    held: list[BaseException] = []
                    while not finished:
                        out = await next_output(stream, held)
                        if isinstance(out, BaseException):  # "thinker rank 2 died while serving ..."
                            raise StageUnavailable(f"thinker {out}")
                        if out.token_ids or out.text:
                            yield Tokens(out)
                        if out.hidden_states is not None:
                            hidden = await self._hidden(out, request)
                            handed = False
                            try:
                                yield hidden
                                handed = True
                            finally:
                                if not handed and self.producer is not None:  # nobody will release it
                                    self.producer.revoke(hidden.ref)
                        if out.finished:
                            finished = True
                            yield Finished(out)
                finally:
                    if not finished:
                        # Cancelled, refused or failed: free the KV blocks now, not at max_tokens.
                        self.loop.call(lambda: self.runner.abort(engine_id))
                        rid = request.request_id
                        _log.info("request %s (engine id %s) ended before it finished", rid, engine_id)

    async def tokenize(self, request: thinker_pb2.TokenizeRequest) -> list[int]:
        """The ids Generate would prefill for this prompt: the same bounds, in the tokenize pool."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set text or chat")
        as_generate = thinker_pb2.ThinkerRequest(**{kind: getattr(request, kind)})
        self._check_prompt_size(as_generate)
        ids = await asyncio.get_running_loop().run_in_executor(self._pool, self._prompt_ids, as_generate)
        check_context(self.max_model_len, prompt_tokens=len(ids))  # the rule Generate's budget applies
        return ids

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The text of `ids` (at most max_model_len of them, inside the vocabulary)."""
        if len(ids) > self.max_model_len:
            raise InvalidRequest(f"token_ids: {len(ids)} ids, at most max_model_len {self.max_model_len}")
        checked = self._in_vocabulary("token_ids", ids)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.tokenizer.decode, checked)

    async def _admit(
        self, request: thinker_pb2.ThinkerRequest
    ) -> tuple[Prompt, SamplingParams, RequestBudget]:
        """Bound, check the sampling, tokenize (in the pool), make the request's budget (the context
        rule, once, on the exact prompt); the request's leases end here."""
        try:
            self._check_prompt_size(request)
            params = sampling_from_proto(request.sampling, self.tokenizer.vocab_size, self.max_model_len)
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(self._pool, self._prompt, request)
            budget = self._budget(prompt, params, request.HasField("hidden_states"))
            spec = grammar_spec(request.sampling)
            if spec is not None and not request.HasField("hidden_states"):
                params = replace(params, grammar=await self.grammars.get(spec))
        finally:
            if request.multimodal:  # copied, refused or cancelled: no lease outlives this
                if self._transport is None:
                    self._transport = TransportContext()
                release_refs(self._transport, request.multimodal)
        return prompt, params, budget

    def _budget(self, prompt: Prompt, params: SamplingParams, hidden_states: bool) -> RequestBudget:
        """The request's budget against this flow's context; the context rule's message if none."""
        try:
            return RequestBudget.of(
                len(unpack_prompt(prompt)[0]),
                params.max_tokens,
                self.max_model_len,
                self.default_max_tokens,
                hidden_states=hidden_states,
            )
        except RequestError as exc:
            raise InvalidRequest(str(exc), reason=exc.reason) from None

    async def _submit(
        self, engine_id: str, prompt: Prompt, params: SamplingParams, budget: RequestBudget, arrival: Arrival
    ) -> Stream:
        stream: Stream = asyncio.Queue()
        try:
            added = self.loop.call(lambda: self.runner.add(engine_id, prompt, params, budget, stream))
            arrival.here()  # its add runs before the next step: it is no longer on its way
            await asyncio.wrap_future(added)
        except (DeviceFailed, DeviceStopped) as exc:
            raise StageUnavailable(f"thinker {exc}") from exc
        return stream

    def _query_block_tokens(self, request: thinker_pb2.ThinkerRequest) -> int:
        """Tokens hidden-state mode appends to the prompt (0 for a text request); refuses the mode
        when this thinker has no image query rows or nowhere to send hidden states."""
        if not request.HasField("hidden_states"):
            return 0
        if self.media is None or self.media.queries is None or self.producer is None:
            raise StageUnavailable(
                "hidden_states: this thinker has no image-generation query embeddings "
                "(the checkpoint's mlp/model.safetensors query_tokens_dict)",
                retryable=False,
            )
        return self.media.query_block_tokens

    def _check_prompt_size(self, request: thinker_pb2.ThinkerRequest) -> None:
        """Refuse what cannot fit before tokenizing (cheap, on the event loop): the prompt's shape,
        then the context rule on the fewest tokens it can have."""
        kind = request.WhichOneof("prompt")
        block = self._query_block_tokens(request)
        rows = self._media_rows(request)
        if kind == "chat":
            pieces = request.chat.pieces
            self._check_pieces(pieces)
            given = sum(len(p.tokens.ids) + len(p.client_tokens.ids) for p in pieces)
            chars, where = sum(len(p.template) + len(p.text) for p in pieces), "chat.pieces"
        elif kind == "text":
            given, chars, where = 0, len(request.text), "prompt"
        elif kind == "token_ids":
            given, chars, where = len(request.token_ids.ids), 0, "token_ids"
        else:
            raise InvalidRequest("prompt: set chat, text or token_ids")
        # A text of n characters has at least n / max_token_chars tokens; media rows are placeholder
        # tokens the prompt holds somewhere.
        least = given + -(-chars // self.tokenizer.max_token_chars)
        if rows > least:
            least, where = rows, "multimodal"
        check_context(
            self.max_model_len,
            prompt_tokens=max(least, 1) + block,
            max_tokens=request.sampling.max_tokens,
            at_least=kind != "token_ids" or where == "multimodal",
            where=where,
            generates=not request.HasField("hidden_states"),
        )

    def _media_rows(self, request: thinker_pb2.ThinkerRequest) -> int:
        """The embedding rows of a multimodal request (its items checked); 0 for a text request."""
        if not request.multimodal:
            return 0
        if self.media is None:
            raise StageUnavailable("multimodal: this thinker takes no embeddings", retryable=False)
        return self.media.check_items(request.multimodal)

    def _check_pieces(self, pieces) -> None:
        if not pieces:
            raise InvalidRequest("chat.pieces: a chat prompt needs at least one piece")
        if len(pieces) > self.max_model_len:
            raise InvalidRequest(
                f"chat.pieces: {len(pieces)} pieces, at most max_model_len {self.max_model_len} are accepted"
            )
        for i, piece in enumerate(pieces):
            if piece.WhichOneof("piece") is None:
                raise InvalidRequest(f"chat.pieces[{i}]: set template, text, tokens or client_tokens")

    def _prompt_ids(self, request: thinker_pb2.ThinkerRequest) -> list[int]:
        """Tokenize (in the tokenize pool); a template whose special tokens alone cannot fit is refused
        before its text is encoded."""
        kind = request.WhichOneof("prompt")
        if kind == "chat":
            pieces = [self._piece(i, p) for i, p in enumerate(request.chat.pieces)]
            segments = self.tokenizer.split_pieces(pieces)
            specials = sum(
                1 if isinstance(seg, int) else len(seg) for seg in segments if not isinstance(seg, str)
            )
            check_context(  # before encoding a template that cannot fit
                self.max_model_len,
                prompt_tokens=specials + self._query_block_tokens(request),
                at_least=True,
                where="chat",
                generates=not request.HasField("hidden_states"),
            )
            ids = self.tokenizer.encode_segments(segments)
        elif kind == "text":  # literal, like client text in `chat`: no string becomes a control token
            ids = self.tokenizer.encode_segments(self.tokenizer.split_pieces([("text", request.text)]))
        else:
            ids = self._in_vocabulary("token_ids", request.token_ids.ids)
        if not ids:
            raise InvalidRequest("prompt: empty after tokenization")
        return ids

    def _in_vocabulary(self, where: str, ids) -> list[int]:
        return in_vocabulary(where, ids, self.tokenizer.vocab_size)

    def _piece(self, i: int, p: thinker_pb2.PromptPiece) -> Piece:
        return prompt_piece(i, p, self.tokenizer.vocab_size, self._special_ids)

    def _prompt(self, request: thinker_pb2.ThinkerRequest) -> Prompt:
        """Token ids, plus the encoder rows and 3D positions of a multimodal request and the query
        block of a hidden-state request (tokenize pool)."""
        ids = self._prompt_ids(request)
        hidden = request.HasField("hidden_states")
        if not request.multimodal and not hidden:
            return ids
        assert self.media is not None  # _check_prompt_size refused it otherwise
        return self.media.build(ids, request.multimodal, image_queries=hidden)

    def _hidden_ref(self, rows, allow_cuda_ipc: bool) -> tensor_pb2.TensorRef:
        """The hidden states as a leased ref of this rank's producer pool (tokenize pool)."""
        assert self.producer is not None
        nbytes = rows.numel() * rows.element_size()
        if rows.is_cuda and not allow_cuda_ipc and nbytes >= self.producer.options.shm_threshold_bytes:
            return encode(rows, transport=self.producer, force="shm")  # the consumer cannot open CUDA IPC
        return encode(rows, transport=self.producer)

    async def _hidden(self, out: RequestOutput, request: thinker_pb2.ThinkerRequest) -> Hidden:
        made = asyncio.get_running_loop().run_in_executor(
            self._pool, self._hidden_ref, out.hidden_states, request.hidden_states.allow_cuda_ipc
        )
        out.hidden_states = None  # the device rows go with the copy
        try:
            ref = await asyncio.shield(made)
        except asyncio.CancelledError:  # the caller left while the ref was made: nobody will release it
            made.add_done_callback(self._revoke_when_made)
            raise
        return Hidden(ref)

    def _revoke_when_made(self, made: asyncio.Future) -> None:
        if not made.cancelled() and made.exception() is None and self.producer is not None:
            self.producer.revoke(made.result())
