"""Where `data prepare` reads documents: text files (each one document), JSONL (each line a
JSON object, its text in one field) and Parquet (each row one document, its text in one
column, read a batch of rows at a time by pyarrow); directories are searched recursively for
all three. A document that cannot be read stops everything with one line naming the file and
the line (JSONL) or the row (Parquet), before anything is written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..schema import DataError
from . import _TEXT_SUFFIXES as TEXT  # what training on a directory reads too
JSONL = frozenset({".jsonl"})
PARQUET = frozenset({".parquet"})
SUFFIXES = TEXT | JSONL | PARQUET


def input_files(inputs: list[str], suffixes=SUFFIXES) -> list[Path]:
    """The files `inputs` name: files as given, directories' files with `suffixes`
    (recursively, sorted by their path in the directory)."""
    files = []
    for name in inputs:
        p = Path(name).expanduser()
        if p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes),
                           key=lambda f: f.relative_to(p).as_posix())
            if not found:
                raise DataError("INPUT", f"directory {name} has no {'/'.join(sorted(suffixes))} "
                                         "files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError("INPUT", f"{name} does not exist")
    return files


def records(path: Path, columns: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """(where, object) of each record: a JSONL file's non-blank lines (`where` is `file:line`),
    or a Parquet file's rows as {column: value} (`file: row N`; only `columns`, each of which
    it must have, read a batch of rows at a time)."""
    if path.suffix in PARQUET:
        yield from _rows(path, columns)
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(where, f"not a JSON object ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(where, f"not a JSON object (a {type(obj).__name__})")
            yield where, obj


def _rows(path: Path, columns: list[str] | None) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 -- pyarrow's own errors for a file that is not one
        raise DataError(str(path), f"not a Parquet file ({e})") from None
    names = table.schema_arrow.names
    for column in columns or ():
        if column not in names:
            raise DataError(str(path), f"no column {column!r} (its columns: {', '.join(names)})")
    row = 0
    for batch in table.iter_batches(batch_size=4096, columns=columns):
        for obj in batch.to_pylist():
            yield f"{path}: row {row}", obj
            row += 1


def documents(path: Path, field: str = "text") -> Iterator[str]:
    """The documents of one file, as text."""
    if path.suffix not in JSONL | PARQUET:
        yield path.read_bytes().decode("utf-8", errors="replace")
        return
    for where, obj in records(path, [field]):
        text = obj.get(field)
        if not isinstance(text, str):
            raise DataError(where, f"no text in field {field!r}" if text is None else
                            f"field {field!r} is a {type(text).__name__}, not text")
        yield text
