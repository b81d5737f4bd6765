"""MingTokenizer: the checkpoint's `tokenizer.json` plus the ids the engine needs, read from its files."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from omnistage.common.checkpoint.shards import CheckpointError
from tokenizers import Tokenizer, decoders

# A prompt piece: ("template", markup whose special-token strings count), ("text", client text) or
# ("tokens", ids generated earlier, taken as they are).
Piece = tuple[Literal["template", "text"], str] | tuple[Literal["tokens"], list[int]]
# A prompt split for encoding: plain-text runs (str), special-token ids (int) and ids taken as they
# are (list), in order.
Segment = str | int | list[int]


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters → the bytes they stand for (GPT-2's printable remapping: printable
    Latin-1 bytes are themselves, the rest shifted to U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    shifted = iter(range(256, 512))
    return {chars.get(b) or chr(next(shifted)): b for b in range(256)}


_BYTE_OF = _byte_level_alphabet()


def _token_content(value: object) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class MingTokenizer:
    def __init__(self, checkpoint_dir: str | Path) -> None:
        root = Path(checkpoint_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{root}: tokenizer.json not found")
        self._tok = Tokenizer.from_file(str(path))
        self._plain = Tokenizer.from_file(str(path))  # special-token strings are ordinary text here
        self._plain.encode_special_tokens = True
        cfg_path = root / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        # The control tokens: special added tokens only. A tokenizer may add ordinary words too (the
        # config-only checkpoint pads its vocabulary with 156k of them): those are text, never split
        # out of a template nor refused in a client's ids.
        self._added = {
            e["content"]: int(i)
            for i, e in cfg.get("added_tokens_decoder", {}).items()
            if e.get("special", True)
        }
        added = self._tok.get_added_tokens_decoder()  # once: ~1.5 s with the config-only checkpoint's 156k
        self._added.update({t.content: i for i, t in added.items() if t.special})
        self.eos_token_id = self.token_id(_token_content(cfg.get("eos_token")) or "<|role_end|>")
        pad = _token_content(cfg.get("pad_token"))
        self.pad_token_id = self.token_id(pad) if pad else self.eos_token_id
        stops = {self.eos_token_id, self.token_id("<|role_end|>")}
        gen_path = root / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            stops.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))
        self._strip = {i: (t.lstrip, t.rstrip) for i, t in added.items() if t.lstrip or t.rstrip}
        # Leftmost, then longest match, as the tokenizer's own added-token matcher.
        names = sorted(self._added, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # No token stands for more characters than this (byte-level BPE: one vocab character per
        # byte), so a text of n characters has at least n / max_token_chars tokens.
        self.max_token_chars = max(map(len, vocab), default=1)
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._token_bytes: dict[int, bytes] = {}  # token_bytes, made on first use (at most the vocab)
        # Once: the tokenizers library counts its added tokens on every call (48 ms with 156k of them,
        # on the event loop of every request).
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (the model's embedding may be padded beyond this)."""
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._added)

    def token_id(self, name: str) -> int:
        tid = self._added.get(name, self._tok.token_to_id(name))
        if tid is None:
            raise KeyError(f"token {name!r} is not in the tokenizer")
        return tid

    def encode(self, text: str) -> list[int]:
        """Trusted text only: special-token strings in `text` become special tokens."""
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=False)
        return encoding.ids

    def split_pieces(self, pieces: Iterable[Piece]) -> list[Segment]:
        """Special tokens of template pieces as ids; everything between them (template and client text
        alike) joined into plain-text runs, so BPE sees the same runs as `encode` of the joined string.
        A token piece's ids stay one list segment (no whitespace is stripped beside them)."""
        segments: list[Segment] = []
        run: list[str] = []
        for kind, text in pieces:
            if kind == "tokens":  # ends the run: BPE never merges across ids taken as they are
                segments += ["".join(run), list(text)]
                run = []
                continue
            pos = 0
            if kind == "template" and self._special_re is not None:
                for match in self._special_re.finditer(text):
                    run.append(text[pos : match.start()])
                    segments += ["".join(run), self._added[match.group()]]
                    run, pos = [], match.end()
            run.append(text[pos:])
        segments.append("".join(run))
        return self._apply_strip(segments)

    def encode_segments(self, segments: list[Segment]) -> list[int]:
        """Ids of `split_pieces` output: plain runs BPE-encoded with special-token strings as text."""
        runs = [s for s in segments if isinstance(s, str) and s]
        encoded = iter(self._plain.encode_batch(runs, add_special_tokens=False) if runs else [])
        ids: list[int] = []
        for seg in segments:
            if isinstance(seg, int):
                ids.append(seg)
            elif isinstance(seg, list):
                ids += seg
            elif seg:
                ids += next(encoded).ids
        return ids

    def encode_pieces(self, pieces: Iterable[Piece]) -> list[int]:
        """A chat prompt: only template pieces can yield special tokens (see the module docstring)."""
        return self.encode_segments(self.split_pieces(pieces))

    def _apply_strip(self, segments: list[Segment]) -> list[Segment]:
        """Added tokens marked lstrip/rstrip swallow the whitespace beside them, as in `encode`."""
        for i, seg in enumerate(segments):
            if isinstance(seg, int) and seg in self._strip:
                lstrip, rstrip = self._strip[seg]
                if lstrip and i > 0 and isinstance(segments[i - 1], str):
                    segments[i - 1] = segments[i - 1].rstrip()
                if rstrip and i + 1 < len(segments) and isinstance(segments[i + 1], str):
                    segments[i + 1] = segments[i + 1].lstrip()
        return segments

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token holding part of a UTF-8 character gives just those
        bytes, which a decode would turn into U+FFFD); a special token's name; b"" for an id the
        tokenizer does not have (the model's vocabulary may be padded). Logprobs show tokens so."""
        got = self._token_bytes.get(token_id)
        if got is None:
            got = self._token_bytes[token_id] = self._bytes_of(token_id)
        return got

    def _bytes_of(self, token_id: int) -> bytes:
        name = self._tok.id_to_token(token_id)
        if name is None:
            return b""
        if name in self._added or not self._byte_level or any(c not in _BYTE_OF for c in name):
            return self._tok.decode([token_id], skip_special_tokens=False).encode()
        return bytes(_BYTE_OF[c] for c in name)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
