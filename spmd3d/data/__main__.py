"""`python -m spmd3d.data prepare INPUT... OUT [--tokenizer=SPEC]`: text to a token file.

INPUT: text files or directories (their .txt/.md/.py/.rst files, recursively, sorted). Every
file is one document: its tokens, then the tokenizer's end-of-text token (bytes: a blank line).
OUT's suffix says the token type, which must hold every id of the vocabulary: `.bin`/`.u16`
uint16 (up to 65,536 ids), `.u32` uint32. Files are tokenized 64 at a time (a HF tokenizer runs
a batch on all cores) and appended as they come, so memory stays one batch whatever the corpus;
OUT appears only when complete (written as OUT.tmp, then renamed).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np

from .. import cli
from ..config import ConfigError
from . import _TEXT_SUFFIXES, DataError

LOG = logging.getLogger("spmd3d")
SUFFIXES = {".bin": np.uint16, ".u16": np.uint16, ".u32": np.uint32}

COMMAND = cli.Command(
    prog="python -m spmd3d.data",
    usage="prepare INPUT... OUT [--tokenizer=SPEC]",
    description=("Tokenize text files or directories (.txt/.md/.py/.rst files, recursively) into "
                 "a flat token file that data.path reads: OUT.bin (uint16) or OUT.u32 (uint32, "
                 "for vocabularies above 65,536), an end-of-text token after every file. SPEC: "
                 "bytes (default), a HF tokenizer.json, or a model directory holding one."),
    flags=(cli.Flag("--tokenizer", kind="str", help="bytes, a tokenizer.json or a HF model "
                                                    "directory (default bytes)"),),
    takes_config=False,
)


def input_files(inputs: list[str]) -> list[Path]:
    files = []
    for name in inputs:
        p = Path(name).expanduser()
        if p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES),
                           key=lambda f: f.relative_to(p).as_posix())
            if not found:
                raise DataError("INPUT", f"directory {name} has no "
                                         f"{'/'.join(sorted(_TEXT_SUFFIXES))} files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError("INPUT", f"{name} does not exist")
    return files


def prepare(inputs: list[str], out: str | Path, tokenizer: str = "bytes") -> tuple[int, str]:
    """Writes OUT; returns (tokens written, dtype name)."""
    from tqdm import tqdm

    from ..tokenizer import load

    out = Path(out)
    if out.suffix not in SUFFIXES:
        raise DataError("OUT", f"{out} must end in {', '.join(SUFFIXES)} (the token type)")
    dtype = SUFFIXES[out.suffix]
    tok = load(tokenizer, "--tokenizer")
    if tok.vocab_size > np.iinfo(dtype).max + 1:
        raise DataError("OUT", f"the tokenizer's {tok.vocab_size:,} ids do not fit {out.suffix} "
                               f"({np.dtype(dtype).name}); name the output .u32")
    files = input_files(inputs)
    eos = list(b"\n\n") if tok.name == "bytes" else [] if tok.eos_id is None else [tok.eos_id]
    tmp, total = out.with_name(out.name + ".tmp"), 0
    try:
        with open(tmp, "wb") as f, tqdm(total=len(files), desc="tokenizing", unit=" files",
                                        disable=None) as bar:
            for i in range(0, len(files), 64):
                batch = files[i:i + 64]
                texts = [p.read_bytes().decode("utf-8", errors="replace") for p in batch]
                for ids in tok.encode_batch(texts):
                    np.asarray(ids + eos, dtype).tofile(f)
                    total += len(ids) + len(eos)
                bar.update(len(batch))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return total, np.dtype(dtype).name


def _run(args: cli.Args) -> int:
    if len(args.positional) < 3 or args.positional[0] != "prepare":
        raise ConfigError("argv", f"usage: {COMMAND.prog} {COMMAND.usage}")
    *inputs, out = args.positional[1:]
    total, dtype = prepare(inputs, out, args.flags.get("--tokenizer", "bytes"))
    LOG.info(f"wrote {total:,} tokens ({dtype}) to {out}; train on it with data.path={out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
