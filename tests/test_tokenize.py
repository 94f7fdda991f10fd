"""Real tokenizers (the `tokenizers` package, as transformers uses it) and
`python -m spmd3d.data prepare`: the token file holds each document's ids and an end-of-text
token, in the smallest type the vocabulary allows, and training reads the same tokens from text."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from helpers import DOCS, bpe_dir
from spmd3d import data, tokenizer
from spmd3d.data import __main__ as prepare_cmd


@pytest.fixture
def corpus(tmp_path):
    for name, text in DOCS.items():
        (tmp_path / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / name).write_text(text)
    return tmp_path / "corpus"


def test_hf_tokenizer_round_trips_and_names_its_specials(tmp_path):
    tok = tokenizer.load(str(bpe_dir(tmp_path / "tok")))
    assert tok.eos_id == 1 and tok.vocab_size <= 300
    ids = tok.encode("def add(a, b):")
    assert ids[0] == 0 and tok.decode(ids[1:]) == "def add(a, b):"
    assert tokenizer.load("bytes").encode("é") == [0xC3, 0xA9]


def test_prepare_writes_each_document_then_end_of_text(tmp_path, corpus):
    tok_dir = bpe_dir(tmp_path / "tok")
    out = tmp_path / "tokens.bin"
    assert prepare_cmd.main(["prepare", str(corpus), str(out), "--tokenizer", str(tok_dir)]) == 0
    tokens = np.fromfile(out, np.uint16)
    tok = tokenizer.load(str(tok_dir))
    want = []
    for name in ("a.txt", "sub/b.md"):  # sorted, text suffixes only
        want += tok.encode(DOCS[name]) + [tok.eos_id]
    assert tokens.tolist() == want
    # training on the text directory reads the same tokens; the token file through data.path
    assert data.load_tokens(str(corpus), str(tok_dir)).tolist() == want
    assert data.load_tokens(str(out)).tolist() == want
    # bytes: the files' bytes, a blank line after each
    out8 = tmp_path / "bytes.bin"
    assert prepare_cmd.main(["prepare", str(corpus / "a.txt"), str(out8)]) == 0
    assert np.fromfile(out8, np.uint16).astype(np.uint8).tobytes() == \
        DOCS["a.txt"].encode() + b"\n\n"


def wordlevel(path, size):
    vocab = {f"w{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_a_large_vocabulary_needs_32_bit_tokens(tmp_path, corpus, capsys):
    big = wordlevel(tmp_path / "big", 70_000)
    (tmp_path / "t.txt").write_text("w1 w69999 w5")
    assert prepare_cmd.main(["prepare", str(tmp_path / "t.txt"), str(tmp_path / "x.bin"),
                             f"--tokenizer={big}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: OUT:") and ".u32" in err and "\n" not in err
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.tmp").exists()
    assert prepare_cmd.main(["prepare", str(tmp_path / "t.txt"), str(tmp_path / "x.u32"),
                             f"--tokenizer={big}"]) == 0
    assert np.fromfile(tmp_path / "x.u32", np.uint32).tolist() == [1, 69999, 5]


@pytest.mark.parametrize("argv,blamed", [
    (["prepare", "missing.txt", "out.bin"], "INPUT"),
    (["prepare", "CORPUS", "out.txt"], "OUT"),
    (["prepare", "CORPUS", "out.bin", "--tokenizer", "nonexistent"], "--tokenizer"),
    (["prepare", "out.bin"], "argv")])
def test_bad_input_is_one_line_and_exit_2(argv, blamed, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [str(corpus) if a == "CORPUS" else a for a in argv]
    assert prepare_cmd.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {blamed}") and "\n" not in err, err
    assert not list(tmp_path.glob("out.*"))


def test_jsonl_and_parquet_give_the_text_files_tokens(tmp_path, corpus):
    """The same documents as JSONL lines (a named field) and as Parquet rows (a column) give
    the tokens the text files give, end-of-text tokens included."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    tok_dir = str(bpe_dir(tmp_path / "tok"))
    texts = [DOCS["a.txt"], DOCS["sub/b.md"]]
    want = tmp_path / "want.bin"
    assert prepare_cmd.main(["prepare", str(corpus), str(want), f"--tokenizer={tok_dir}"]) == 0
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"id": i, "body": t}) + "\n\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"id": [0, 1], "body": texts}), tmp_path / "docs.parquet")
    for name in ("docs.jsonl", "docs.parquet"):
        out = tmp_path / f"{name}.bin"
        assert prepare_cmd.main(["prepare", str(tmp_path / name), str(out), "--field=body",
                                 f"--tokenizer={tok_dir}"]) == 0
        assert np.fromfile(out, np.uint16).tolist() == np.fromfile(want, np.uint16).tolist()


@pytest.mark.parametrize("content,blamed", [
    ('{"text": "one"}\n{"text": "two"\n', "docs.jsonl:2: not a JSON object"),
    ('{"text": "one"}\n\n["a list"]\n', "docs.jsonl:3: not a JSON object (a list)"),
    ('{"text": "one"}\n{"body": "two"}\n', "docs.jsonl:2: no text in field 'text'"),
    ('{"text": 5}\n', "docs.jsonl:1: field 'text' is a int"),
    ("PARQUET", "docs.parquet: no column 'text' (its columns: body)")])
def test_unreadable_documents_are_named_by_file_and_line(content, blamed, tmp_path, capsys):
    """A malformed JSONL line, a missing field or a missing Parquet column: one line naming
    the file and the line, exit 2, and no output at all (not even a partial one)."""
    if content == "PARQUET":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "docs.parquet")
        name = "docs.parquet"
    else:
        name = "docs.jsonl"
        (tmp_path / name).write_text(content)
    out = tmp_path / "out.bin"
    assert prepare_cmd.main(["prepare", str(tmp_path / name), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path}/") and blamed in err and "\n" not in err, err
    assert not list(tmp_path.glob("out.*"))
