"""Text <-> token ids, as `data.tokenizer` names it: `bytes` (UTF-8 bytes, vocabulary 256, no
files), or a Hugging Face tokenizer: a `tokenizer.json` or a model directory holding one, read
by the `tokenizers` package (the Rust library transformers itself uses, so ids match).

A HF tokenizer's end-of-text id comes from the directory's `generation_config.json`,
`config.json` or `tokenizer_config.json` (first found), else from the usual token names.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from .schema import DataError

_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


class Bytes:
    """UTF-8 bytes: ids 0..255, no end-of-text token (documents are joined by a blank line)."""

    name, vocab_size, eos_id, stop_ids = "bytes", 256, None, ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HF:
    """A `tokenizers.Tokenizer` from `tokenizer.json`; `encode` adds what its post-processor
    adds (LLaMA's begin-of-text token)."""

    def __init__(self, path: str | Path, field: str = "data.tokenizer"):
        from tokenizers import Tokenizer

        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise DataError(field, f"{path!r} is neither 'bytes' nor a tokenizer.json or a "
                                   "directory holding one")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 -- the library's own parse errors
            raise DataError(field, f"{file} is not a tokenizer.json ({e})") from None
        self.name = str(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.stop_ids = self._eos(file.parent)
        self.eos_id = self.stop_ids[0] if self.stop_ids else None

    def _eos(self, directory: Path) -> tuple[int, ...]:
        """The ids that end a text; the first is written after each document."""
        for name in ("generation_config.json", "config.json"):
            f = directory / name
            if f.is_file():
                ids = json.loads(f.read_text()).get("eos_token_id")
                if ids is not None:  # a list in LLaMA 3 instruct: end of text, end of turn
                    return tuple(int(i) for i in (ids if isinstance(ids, list) else [ids]))
        f = directory / "tokenizer_config.json"
        if f.is_file():
            token = json.loads(f.read_text()).get("eos_token")
            token = token.get("content") if isinstance(token, dict) else token
            if token and self._tok.token_to_id(token) is not None:
                return (self._tok.token_to_id(token),)
        return tuple(self._tok.token_to_id(t) for t in _EOS_NAMES
                     if self._tok.token_to_id(t) is not None)[:1]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once, on all cores (the library's own thread pool)."""
        return [e.ids for e in self._tok.encode_batch(texts)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, each one's character span) of text that writes its own special tokens (a
        chat template's output): nothing added, as transformers tokenizes a rendered chat."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def load(spec: str, field: str = "data.tokenizer"):
    """The tokenizer `spec` names: 'bytes', a tokenizer.json, or a directory holding one."""
    return Bytes() if spec == "bytes" else HF(spec, field)


def token_dtype(vocab_size: int):
    """The smallest unsigned type that holds every id."""
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32
