"""`python -m spmd3d.data prepare INPUT... OUT [--tokenizer=SPEC] [--field=NAME]`: documents to a
token file.

INPUT: files or directories (their .txt/.md/.py/.rst, .jsonl and .parquet files, recursively,
sorted). A text file is one document; a JSONL line is one (its text in field NAME, default
`text`), as is a Parquet row (column NAME) (`sources.py`). Each document is its tokens, then the
tokenizer's end-of-text token (bytes: a blank line). OUT's suffix says the token type, which
must hold every id of the vocabulary: `.bin`/`.u16` uint16 (up to 65,536 ids), `.u32` uint32.
Documents are tokenized 256 at a time (a HF tokenizer runs a batch on all cores) and appended
as they come, so memory stays one batch whatever the corpus; OUT appears only when complete
(written as OUT.tmp, then renamed), and a document that cannot be read (a malformed JSONL
line, a missing field or column) stops it with one line naming the file and the line or row.

`--chat --seq-len=N [--truncate]`: conversations (`messages: [{role, content}]`: a JSONL field
or a Parquet column of lists of structs) rendered
with the tokenizer's chat template, the loss on the assistant's tokens alone, packed whole into
windows of N + 1 tokens (`chat.py`), written as OUT.npy [windows, N + 1] int32 (train with
train.seq_len=N). A conversation longer than a window is refused, or cut with `--truncate`.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

import numpy as np

from .. import cli
from ..config import ConfigError
from . import DataError
from .sources import documents, input_files

LOG = logging.getLogger("spmd3d")
SUFFIXES = {".bin": np.uint16, ".u16": np.uint16, ".u32": np.uint32}
BATCH = 256  # documents per tokenizer call

COMMAND = cli.Command(
    prog="python -m spmd3d.data",
    usage="prepare INPUT... OUT [--tokenizer=SPEC] [--field=NAME] [--chat --seq-len=N "
          "[--truncate]] | bench [CONFIG.yaml] [key=value ...] [--steps=N]",
    description=("Tokenize documents into a flat token file that data.path reads: OUT.bin "
                 "(uint16) or OUT.u32 (uint32, for vocabularies above 65,536), an end-of-text "
                 "token after every document. INPUT: text files (.txt/.md/.py/.rst: one "
                 "document each), JSONL (a document per line, its text in field NAME), Parquet "
                 "(a document per row, column NAME), or directories of them. SPEC: bytes "
                 "(default), a HF tokenizer.json, or a model directory holding one. --chat: "
                 "JSONL conversations through the tokenizer's chat template, trained on the "
                 "assistant's tokens, packed into windows of N + 1 tokens in OUT.npy. bench: "
                 "how fast a config's training data is read, in tokens/s on one host core."),
    flags=(cli.Flag("--tokenizer", kind="str", help="bytes, a tokenizer.json or a HF model "
                                                    "directory (default bytes)"),
           cli.Flag("--field", kind="str", help="the JSONL field or Parquet column holding "
                                                "the text (default text)"),
           cli.Flag("--chat", help="JSONL conversations (messages) through the chat template"),
           cli.Flag("--seq-len", kind="int", minimum=1, help="--chat: the windows' train.seq_len"),
           cli.Flag("--truncate", help="--chat: cut a conversation longer than a window"),
           cli.Flag("--steps", kind="int", minimum=1, help="bench: batches to time (50)")),
    takes_config=False,
)


def _every_document(files: list[Path], field: str, bar):
    """The files' documents one after another (batches span files), the bar moved by each
    file's bytes as it is done."""
    for path in files:
        yield from documents(path, field)
        bar.update(path.stat().st_size)


def prepare(inputs: list[str], out: str | Path, tokenizer: str = "bytes",
            field: str = "text") -> tuple[int, str]:
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
        with open(tmp, "wb") as f, tqdm(total=sum(p.stat().st_size for p in files), unit="B",
                                        unit_scale=True, desc="tokenizing", disable=None) as bar:
            texts = _every_document(files, field, bar)
            while batch := list(itertools.islice(texts, BATCH)):
                for ids in tok.encode_batch(batch):
                    np.asarray(ids + eos, dtype).tofile(f)
                    total += len(ids) + len(eos)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return total, np.dtype(dtype).name


def prepare_chat(inputs: list[str], out: str | Path, tokenizer: str, seq_len: int,
                 truncate: bool = False) -> tuple[int, int]:
    """Writes OUT.npy of packed conversations; returns (windows, tokens trained on)."""
    from tqdm import tqdm

    from ..tokenizer import load
    from . import chat
    from .sources import records

    out = Path(out)
    if out.suffix != ".npy":
        raise DataError("OUT", f"{out} must end in .npy (--chat writes windows of tokens)")
    tok = load(tokenizer, "--tokenizer")
    if tok.name == "bytes" or tok.eos_id is None:
        raise DataError("--tokenizer", "--chat needs a HF tokenizer with an end-of-text id")
    compiled, specials = chat.template(tokenizer)
    files = input_files(inputs, suffixes=frozenset({".jsonl", ".parquet"}))
    raw, trained = out.with_name(out.name + ".rows"), 0
    tmp = out.with_name(out.name + ".tmp.npy")
    try:
        with open(raw, "wb") as f:
            packer = chat.Packer(seq_len + 1, tok.eos_id, lambda row: row.tofile(f))
            for path in tqdm(files, desc="conversations", unit=" files", disable=None):
                for where, obj in records(path, ["messages"]):
                    ids, on = chat.example(tok, compiled, specials, obj.get("messages"), where)
                    if len(ids) + 1 > seq_len + 1:
                        if not truncate:
                            raise DataError(where, f"the conversation is {len(ids) + 1} tokens "
                                                   f"with its end of text, longer than a window "
                                                   f"of seq_len + 1 = {seq_len + 1} (--truncate "
                                                   "cuts it)")
                        ids, on = ids[:seq_len], on[:seq_len]
                    trained += sum(on) + 1
                    packer.add(ids, on)
            packer.close()
        if not packer.windows:
            raise DataError("INPUT", "no conversations found")
        rows = np.memmap(raw, np.int32, mode="r").reshape(-1, seq_len + 1)
        np.save(tmp, rows)
        del rows
        os.replace(tmp, out)
    finally:
        raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return packer.windows, trained


def bench(overrides: list[str], steps: int = 50) -> dict:
    """The training data of a config (`data.path` or `data.mixture`, as `train` reads it),
    read batch by batch on this one host core: tokens/s, after one batch to warm up."""
    import time

    from .. import config
    from .loader import training_data

    path = overrides[0] if overrides and overrides[0].endswith((".yaml", ".yml")) else None
    cfg = config.load(path, overrides[1:] if path else overrides)
    batches, _ = training_data(cfg)
    b = cfg.train.global_batch
    batches.batch(0, b)
    start = time.perf_counter()
    for s in range(1, steps + 1):
        batches.batch(s, b)
    seconds = time.perf_counter() - start
    tokens = steps * b * cfg.train.seq_len
    return {"tokens_per_s": tokens / seconds, "steps": steps, "global_batch": b,
            "seq_len": cfg.train.seq_len, "seconds": seconds}


def _run(args: cli.Args) -> int:
    if args.positional[:1] == ["bench"]:
        r = bench(args.positional[1:], args.flags.get("--steps", 50))
        LOG.info(f"{r['tokens_per_s']:,.0f} tokens/s on one host core ({r['steps']} batches of "
                 f"{r['global_batch']} x {r['seq_len']} tokens in {r['seconds']:.2f} s)")
        return 0
    if len(args.positional) < 3 or args.positional[0] != "prepare":
        raise ConfigError("argv", f"usage: {COMMAND.prog} {COMMAND.usage}")
    *inputs, out = args.positional[1:]
    tokenizer = args.flags.get("--tokenizer", "bytes")
    if args.flags.get("--chat"):
        if "--seq-len" not in args.flags:
            raise DataError("--seq-len", "--chat packs windows of seq_len + 1 tokens: name N")
        windows, trained = prepare_chat(inputs, out, tokenizer, args.flags["--seq-len"],
                                        bool(args.flags.get("--truncate")))
        LOG.info(f"wrote {windows:,} windows of {args.flags['--seq-len'] + 1} tokens "
                 f"({trained:,} trained on) to {out}; train on it with data.path={out} "
                 f"train.seq_len={args.flags['--seq-len']}")
        return 0
    total, dtype = prepare(inputs, out, tokenizer, args.flags.get("--field", "text"))
    LOG.info(f"wrote {total:,} tokens ({dtype}) to {out}; train on it with data.path={out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
