from __future__ import annotations

from omnistage.services.thinker.engine.detokenizer import Detokenizer
from omnistage.services.thinker.engine.stop import StopStringMatcher
from omnistage.services.thinker.models.tokenizer import MingTokenizer

from tests.services.thinker.engine.engine_fakes import ByteTokenizer


def stream(text: str, stop: tuple[str, ...] = (), prompt: str = "Hi: ") -> tuple[list[str], Detokenizer]:
    tok = ByteTokenizer()
    detok = Detokenizer(tok, tok.encode(prompt), stop)
    deltas = []
    for t in tok.encode(text):
        deltas.append(detok.add(t))
        if detok.stopped:
            break
    if not detok.stopped:
        deltas.append(detok.finish())
    return deltas, detok


def test_multibyte_characters_are_never_split():
    text = "你好, world 🙂! ü"
    deltas, detok = stream(text)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # one byte per token: the 3-byte and 4-byte characters arrive whole on their last byte
    assert "你" in deltas and "🙂" in deltas
    assert deltas.count("") >= 2 + 2 + 3 + 1


def test_stop_string_straddling_tokens_is_excluded_and_stops():
    deltas, detok = stream("answer</end>ignored", stop=("</end>",))
    assert detok.stopped
    assert "".join(deltas) == "answer"


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    deltas, detok = stream("a</en b", stop=("</end>",))
    assert not detok.stopped
    assert "".join(deltas) == "a</en b"
    # "</en" was held back until the space proved it was no stop string
    assert "a</en" not in deltas[:5]


def test_unfinished_stop_prefix_is_flushed_at_the_end():
    deltas, detok = stream("xx</e", stop=("</end>",))
    assert deltas[-1] == "</e" and "".join(deltas) == "xx</e"


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["STOP", "ST"])
    assert m.feed("abS") == "ab"
    assert m.feed("Txyz") == ""
    assert m.stopped


def test_stop_string_with_multibyte_characters():
    deltas, detok = stream("回答。结束了", stop=("结束",))
    assert detok.stopped and "".join(deltas) == "回答。"


def _ming_stream(tok, ids: list[int], keep: bool) -> str:
    detok = Detokenizer(tok, tok.encode("<role>ASSISTANT</role>"), keep_special=keep)
    text = "".join(detok.add(t) for t in ids) + detok.finish()
    assert text == detok.text
    return text


def test_special_tokens_are_dropped_from_the_text_unless_kept(tiny_ckpt):
    tok = MingTokenizer(tiny_ckpt)
    reserved = tok.token_id("<|reserved_token_50|>")
    ids = [
        *tok.encode("Hello"),
        reserved,
        *tok.encode(" world"),
        tok.token_id("<tool_call>"),
        *tok.encode("!"),
    ]
    assert _ming_stream(tok, ids, keep=False) == "Hello world!"
    assert _ming_stream(tok, ids, keep=True) == "Hello<|reserved_token_50|> world<tool_call>!"


def test_a_special_token_alone_or_last_gives_no_text(tiny_ckpt):
    tok = MingTokenizer(tiny_ckpt)
    reserved = tok.token_id("<|reserved_token_50|>")
    assert _ming_stream(tok, [reserved, reserved], keep=False) == ""
    assert _ming_stream(tok, [*tok.encode("你好"), reserved], keep=False) == "你好"
