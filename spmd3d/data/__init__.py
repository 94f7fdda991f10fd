"""Host-side token data for language-model training.

Everything here is plain numpy on the host. The batch for a training step is a
pure function of (tokens, seq_len, seed, step, global_batch), so the data a run
sees does not depend on the device mesh, the number of processes or the number
of microbatches, and resuming at step ``s`` needs nothing but ``s``.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import numpy as np

from ..schema import DataError  # noqa: F401 -- where users import it from

_CORPUS_CAP = 16 * 1024 * 1024
_SEPARATOR = b"\n\n"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
_TEXT_SUFFIXES = frozenset({".txt", ".md", ".py", ".rst"})


def _concat_files(files: list[Path], cap: int | None = None) -> bytes:
    """Concatenate file contents, each followed by a blank-line separator, optionally capped."""
    from tqdm import tqdm

    parts, total = [], 0
    for f in tqdm(files, desc="reading the corpus", unit=" files", disable=None, leave=False):
        parts.append(f.read_bytes() + _SEPARATOR)
        total += len(parts[-1])
        if cap is not None and total >= cap:
            break
    data = b"".join(parts)
    return data[:cap] if cap is not None else data


@functools.cache
def default_corpus() -> np.ndarray:
    """The embedded default corpus: byte tokens (vocab 256) of the standard library's ``.py`` sources.

    Every Python install ships it, so training works out of the box with no download. The file list
    is sorted by relative path (site-packages and the test/tests/idlelib/lib2to3 subtrees excluded
    to keep it code-like and modest), so the corpus is deterministic for a given Python build.
    Capped at 16 MiB. The result is cached and read-only.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # the excluded subtrees are never walked: site-packages may hold gigabytes of packages
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        files += [p for p in (Path(top) / n for n in names if n.endswith(".py")) if p.is_file()]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    arr = np.frombuffer(_concat_files(files, _CORPUS_CAP), dtype=np.uint8)
    arr.setflags(write=False)
    return arr


def _text_tokens(texts, tokenizer: str) -> np.ndarray:
    """Documents (a list of bytes, or one `bytes`) as tokens: raw bytes, or the HF tokenizer's
    ids with its end-of-text token after each document."""
    if tokenizer == "bytes":
        return np.frombuffer(texts if isinstance(texts, bytes) else b"".join(
            t + _SEPARATOR for t in texts), dtype=np.uint8)
    from tqdm import tqdm

    from ..tokenizer import load, token_dtype

    tok = load(tokenizer)
    docs = [texts] if isinstance(texts, bytes) else texts
    ids: list[int] = []
    for i in tqdm(range(0, len(docs), 64), desc="tokenizing", unit=" batches", disable=None,
                  leave=False):
        for doc in tok.encode_batch([d.decode("utf-8", errors="replace") for d in docs[i:i + 64]]):
            ids.extend(doc + ([] if tok.eos_id is None else [tok.eos_id]))
    return np.asarray(ids, token_dtype(tok.vocab_size))


@functools.lru_cache(maxsize=2)
def _cached_corpus_tokens(tokenizer: str) -> np.ndarray:
    """The embedded corpus through a HF tokenizer (in pieces, on all cores)."""
    text = default_corpus().tobytes()
    return _text_tokens([text[i:i + (1 << 20)] for i in range(0, len(text), 1 << 20)], tokenizer)


def _nonempty(arr: np.ndarray, path: str) -> np.ndarray:
    if arr.size == 0:
        raise DataError("data.path", f"{path!r} holds no tokens")
    return arr


def load_tokens(path: str, tokenizer: str = "bytes") -> np.ndarray:
    """Load a 1-D integer token array from ``path``.

    ``''`` gives :func:`default_corpus`. Pre-tokenized files are memory-mapped, never read whole, so
    corpora larger than host memory work: ``.npy`` (1-D integer), ``.bin``/``.u16`` (raw uint16),
    ``.u32`` (raw uint32). Any other file, or a directory (recursively, sorted, only
    .txt/.md/.py/.rst files), is text tokenized with ``tokenizer``: ``'bytes'`` (uint8, vocab 256) or a Hugging Face
    tokenizer (`tokenizer.py`; its end-of-text token after each file). For a large corpus,
    tokenize once with ``python -m spmd3d.data prepare`` and train on the token file.
    """
    if path == "":
        return default_corpus() if tokenizer == "bytes" else _cached_corpus_tokens(tokenizer)
    p = Path(os.path.expanduser(path))
    if not p.exists():
        raise DataError("data.path", f"{path!r} does not exist")
    try:
        if p.is_dir():
            files = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES),
                           key=lambda f: f.relative_to(p).as_posix())
            if not files:
                raise DataError("data.path", f"directory {path!r} has no {'/'.join(sorted(_TEXT_SUFFIXES))} files")
            if tokenizer == "bytes":
                return _nonempty(np.frombuffer(_concat_files(files), dtype=np.uint8), path)
            return _nonempty(_text_tokens([f.read_bytes() for f in files], tokenizer), path)
        suffix = p.suffix.lower()
        if suffix == ".npy":
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
            if arr.ndim not in (1, 2) or arr.dtype.kind not in "ui":
                raise DataError("data.path", f"{path!r} must hold a 1-D integer array (a token "
                                             f"stream) or a 2-D one (windows), got {arr.dtype} "
                                             f"{arr.shape}")
            return _nonempty(arr, path)
        if suffix in (".bin", ".u16", ".u32"):
            dtype = np.uint32 if suffix == ".u32" else np.uint16
            if p.stat().st_size == 0:
                raise DataError("data.path", f"{path!r} holds no tokens")
            return _nonempty(np.memmap(p, dtype=dtype, mode="r"), path)
        return _nonempty(_text_tokens(p.read_bytes(), tokenizer), path)
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError("data.path", f"cannot read {path!r}: {e}") from e


def held_out(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the last `fraction` of the corpus (of its windows,
    for packed windows) held out, so no training window (which reads only its own part)
    overlaps a held-out one. Views, no copy."""
    cut = tokens.shape[0] - int(tokens.shape[0] * fraction)
    return tokens[:cut], tokens[cut:]


def samples(step: int, global_batch: int, process_index: int = 0,
            process_count: int = 1) -> np.ndarray:
    """The global sample indices of this process's rows of step `step`'s batch: rows
    ``process_index * b_local ...`` of samples ``step * global_batch ...``."""
    if global_batch < 1 or global_batch % process_count:
        raise DataError("train.global_batch", f"global_batch {global_batch} must be a positive "
                                              f"multiple of the process count {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    b_local = global_batch // process_count
    return step * global_batch + process_index * b_local + np.arange(b_local, dtype=np.int64)


class TokenBatches:
    """Fixed-length training windows drawn from a 1-D token array, or given as the rows of a
    2-D one (packed examples, `data prepare --chat`: each row one window of `seq_len + 1`
    tokens, a token not trained on as a label stored as -(id + 1)).

    The corpus is cut into ``W = (N - 1) // seq_len`` non-overlapping windows of ``seq_len + 1``
    tokens (stride ``seq_len``, so consecutive windows share one token and every token but the
    first is a label exactly once per epoch); inputs are ``window[:-1]``, labels ``window[1:]``.
    Each epoch visits every window once in the order ``np.random.default_rng([seed, epoch])
    .permutation(W)``. Sample ``k`` (global, counting from 0: step ``s`` holds samples
    ``s*global_batch ... (s+1)*global_batch - 1``) is window ``perm_{k // W}[k % W]``.

    So the batch of a step is a pure function of (tokens, seq_len, seed, step, global_batch):
    resuming at step ``s`` needs only ``s``, and neither the device mesh nor the number of
    microbatches changes the data.
    """

    _PERM_CACHE = 2  # a batch usually touches one epoch, at most two at an epoch boundary

    def __init__(self, tokens, seq_len: int, seed: int, vocab_size: int,
                 stream: int | None = None):
        tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
        if tokens.ndim not in (1, 2) or tokens.dtype.kind not in "ui":
            raise DataError("data.path", f"tokens must be a 1-D or 2-D integer array, got "
                                         f"{tokens.dtype} {tokens.shape}")
        if tokens.ndim == 2 and tokens.shape[1] != int(seq_len) + 1:
            raise DataError("train.seq_len", f"the data's windows are {tokens.shape[1]} tokens "
                                             f"(seq_len + 1): train.seq_len must be "
                                             f"{tokens.shape[1] - 1}, not {seq_len}")
        if int(seq_len) < 1:
            raise DataError("train.seq_len", f"seq_len must be >= 1, got {seq_len}")
        if int(vocab_size) < 1:
            raise DataError("model.vocab_size", f"vocab_size must be >= 1, got {vocab_size}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.stream = stream  # a mixture's source: its own permutations for the same seed
        self.vocab_size = int(vocab_size)
        self.num_windows = tokens.shape[0] if tokens.ndim == 2 else \
            (tokens.shape[0] - 1) // self.seq_len
        if self.num_windows < 1:
            raise DataError("train.seq_len", f"corpus has {tokens.shape[0]} tokens, fewer than one window of "
                                             f"seq_len + 1 = {self.seq_len + 1}")
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """Window order of ``epoch``; the last couple are cached since steps walk epochs in order."""
        perm = self._perms.get(epoch)
        if perm is None:
            key = [self.seed, epoch] + ([] if self.stream is None else [self.stream])
            perm = np.random.default_rng(key).permutation(self.num_windows)
            if len(self._perms) >= self._PERM_CACHE:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def window_ids(self, step: int, global_batch: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Window index of each row of this process's slice of the step's global batch."""
        return self.windows_at(samples(step, global_batch, process_index, process_count))

    def windows_at(self, k: np.ndarray) -> np.ndarray:
        """The window of each global sample index in `k` (the k-th window this data gives)."""
        epochs, pos = np.divmod(k, self.num_windows)
        ids = np.empty(k.shape, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            ids[sel] = self.permutation(int(e))[pos[sel]]
        return ids

    def batch(self, step: int, global_batch: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """This process's rows of the step's global batch: int32 ``[global_batch // process_count, seq_len + 1]``.

        Rows ``process_index * b_local ...`` of the global batch, so concatenating all processes'
        slices in order gives the global batch. Only those rows' windows are read from the
        (possibly memory-mapped) token array, with one vectorized gather. Token ids are range-checked
        here, per batch, because scanning a huge memory-mapped corpus up front would be slow.
        """
        return self.rows(self.window_ids(step, global_batch, process_index, process_count), step)

    def rows(self, ids: np.ndarray, step: int) -> np.ndarray:
        """int32 [len(ids), seq_len + 1]: the windows `ids`, their ids range-checked."""
        if self.tokens.ndim == 2:
            order = np.argsort(ids)  # a memory map reads sorted rows best
            rows = np.empty((ids.size, self.seq_len + 1), self.tokens.dtype)
            rows[order] = self.tokens[ids[order]]
            flagged = rows < 0
            rows = np.where(flagged, -rows.astype(np.int64) - 1, rows)
        else:
            index = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)
            rows, flagged = np.asarray(self.tokens[index]), None
        if rows.size:
            hi = rows.max()
            if hi >= self.vocab_size:
                raise DataError("data.path", f"token id {int(hi)} >= vocab_size {self.vocab_size} "
                                             f"(step {step}, window {int(ids[(rows >= self.vocab_size).any(1)][0])})")
            if rows.dtype.kind == "i" and rows.min() < 0:
                raise DataError("data.path", f"negative token id {int(rows.min())} (step {step})")
        rows = rows.astype(np.int32)
        return rows if flagged is None else np.where(flagged, -rows - 1, rows)
