"""A small byte-level BPE tokenizer with every Ming special token (ming.md §7.1), for the tiny checkpoint.

Trained at write time on an embedded English + Chinese corpus so multi-byte UTF-8 is exercised; the
special tokens follow the BPE vocabulary in the real order, so their ids differ from the release and
code must read them from the files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# ming.md §7.1, in id order (156891 … 157178 in the release).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|startoftext|>",
    "<|endoftext|>",
    "[CLS]",
    "[gMASK]",
    "<|role_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    *(f"<|reserved_token_{i}|>" for i in range(5, 256)),
    "<role>",
    "</role>",
    "<|arithmetic_end|>",
    "<|number_end|>",
    "<|arithmetic_start|>",
    "<|number_start|>",
    "<imagePatch>",
    "<image>",
    "</image>",
    "<video>",
    "</video>",
    "<gen_imagePatch>",
    "<gen_image>",
    "</gen_image>",
    "<imageHere>",
    "<end_of_chunk>",
    "<end_of_audio>",
    "<audioPatch>",
    "<audio>",
    "</audio>",
    "<gen_audioPatch>",
    "<gen_audio>",
    "</gen_audio>",
    "<audioHere>",
    "<framePatch>",
    "<text>",
    "<asr>",
    "<tts>",
)

BPE_VOCAB_SIZE = 1200

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, world! How are you today? I am fine, thank you. What is the weather like in Hangzhou?
Describe the image in detail. What is happening in this video? Please transcribe the audio clip.
The model reads text, images, audio and video, and answers with text, speech or a new picture.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 -7 1e-6.
Punctuation: ( ) [ ] { } < > : ; " ' / \\ | _ - + = * & ^ % $ # @ !
Serving large mixture-of-experts models needs paged attention, continuous batching and tensor parallelism.
SYSTEM HUMAN ASSISTANT OBSERVATION detailed thinking off.
You are a friendly AI assistant. Generate an image of a red panda eating bamboo under the snow.
def main():\n    print("hello")\n    return 0\n
你好，世界！今天天气怎么样？我很好，谢谢你。你是一个友好的AI助手。
请详细描述这张图片。这段视频里发生了什么？请把这段音频转写成文字。
杭州的西湖非常美丽，春天的时候桃花盛开，游客很多。
模型可以理解文字、图像、音频和视频，并用文字、语音或者图片回答。
人工智能正在改变我们的生活和工作方式。大规模专家混合模型需要高效的推理服务。
"""


def train_byte_bpe(
    corpus: str, special_tokens: tuple[str, ...], vocab_size: int = BPE_VOCAB_SIZE
) -> Tokenizer:
    """A byte-level BPE trained on `corpus`, with `special_tokens` added after the BPE vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    lines = [line for line in corpus.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def _train(corpus: str) -> Tokenizer:
    return train_byte_bpe(corpus, SPECIAL_TOKENS)


def added_tokens_decoder(ids: dict[str, int]) -> dict[str, dict[str, Any]]:
    """`tokenizer_config.json`'s `added_tokens_decoder` for special tokens (name → id), in their order."""
    return {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }


def write_tiny_tokenizer(out_dir: str | Path) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return name → id."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train(CORPUS)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder(ids),
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "cls_token": "[CLS]",
        "eos_token": "<|role_end|>",
        "gmask_token": "[gMASK]",
        "model_max_length": 32768,
        "pad_token": "<|role_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {
        "bos_token": "<|startoftext|>",
        "cls_token": "[CLS]",
        "eos_token": "<|role_end|>",
        "pad_token": "<|role_end|>",
        "additional_special_tokens": list(SPECIAL_TOKENS),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
    return ids


_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "ch",
    "sh",
    "tr",
    "br",
)
_VOWELS = ("a", "e", "i", "o", "u")


def filler_words(count: int) -> list[str]:
    """`count` distinct pronounceable words (" ka", " kalo", " kalomi", ...: syllables, a leading space)."""
    syllables = [c + v for c in _ONSETS for v in _VOWELS]
    words: list[str] = []
    for length in (1, 2, 3, 4):
        frontier = [""]
        for _ in range(length):
            frontier = [w + s for w in frontier for s in syllables]
        for w in frontier:
            words.append(" " + w)
            if len(words) == count:
                return words
    raise ValueError(f"{count} filler words: more than this scheme makes")


def pad_tokenizer(out_dir: str | Path, vocab_size: int) -> int:
    """Extend the tokenizer in `out_dir` with filler words up to `vocab_size` ids (a config-only
    checkpoint at a release's size: every id its random-weight model samples then decodes to a
    speakable word instead of nothing, so speech and text downstream get real work). Returns how
    many were added."""
    path = Path(out_dir) / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing <= 0:
        return 0
    vocab = tok.get_vocab(with_added_tokens=True)
    words = [w for w in filler_words(missing + len(vocab)) if w not in vocab][:missing]
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    tok.save(str(path))
    return len(words)
