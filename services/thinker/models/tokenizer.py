"""MingTokenizer: the checkpoint's `tokenizer.json` plus the ids the engine needs, read from its files.

Added tokens (`<role>`, `<|role_end|>`, `<image>`, ...) are matched whole in text; no BOS/EOS is
added (ming.md §7.1). Generation stops on `<|role_end|>` (eos) and any eos ids of
generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.common.checkpoint.shards import CheckpointError
from tokenizers import Tokenizer


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
        cfg_path = root / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._added = {e["content"]: int(i) for i, e in cfg.get("added_tokens_decoder", {}).items()}
        self._added.update({t.content: i for i, t in self._tok.get_added_tokens_decoder().items()})
        self.eos_token_id = self.token_id(_token_content(cfg.get("eos_token")) or "<|role_end|>")
        pad = _token_content(cfg.get("pad_token"))
        self.pad_token_id = self.token_id(pad) if pad else self.eos_token_id
        stops = {self.eos_token_id, self.token_id("<|role_end|>")}
        gen_path = root / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            stops.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (the model's embedding may be padded beyond this)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._added)

    def token_id(self, name: str) -> int:
        tid = self._added.get(name, self._tok.token_to_id(name))
        if tid is None:
            raise KeyError(f"token {name!r} is not in the tokenizer")
        return tid

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
