"""Tests for spmd3d.data: host-side, deterministic, mesh-independent token batches."""

import numpy as np
import pytest

from spmd3d.data import DataError, TokenBatches, default_corpus, load_tokens


def test_default_corpus():
    a, b = default_corpus(), default_corpus()
    assert a.dtype == np.uint8 and a.ndim == 1
    assert 1 << 20 < a.size <= 16 << 20
    assert np.array_equal(a, b)
    assert b"def " in a[:1 << 20].tobytes()
    assert load_tokens("") is a


def test_batch_determinism_and_shift():
    tokens = default_corpus()
    tb = TokenBatches(tokens, seq_len=64, seed=0, vocab_size=256)
    x = tb.batch(3, 8)
    assert x.shape == (8, 65) and x.dtype == np.int32
    assert np.array_equal(x, TokenBatches(tokens, 64, 0, 256).batch(3, 8))
    assert not np.array_equal(x, TokenBatches(tokens, 64, 1, 256).batch(3, 8))
    assert not np.array_equal(x, tb.batch(4, 8))
    for row, w in zip(x, tb.window_ids(3, 8)):
        start = w * 64
        assert np.array_equal(row[:-1], tokens[start:start + 64])  # inputs
        assert np.array_equal(row[1:], tokens[start + 1:start + 65])  # labels = next tokens


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_compose_global_batch(process_count):
    tb = TokenBatches(default_corpus(), 32, seed=7, vocab_size=256)
    for step in (0, 5):
        full = tb.batch(step, 16)
        parts = [tb.batch(step, 16, i, process_count) for i in range(process_count)]
        assert all(p.shape == (16 // process_count, 33) for p in parts)
        assert np.array_equal(np.concatenate(parts), full)


def test_epoch_visits_every_window_once():
    seq_len, n_windows = 4, 24
    tokens = np.arange(n_windows * seq_len + 1, dtype=np.int32)
    tb = TokenBatches(tokens, seq_len, seed=3, vocab_size=10_000)
    assert tb.num_windows == n_windows
    # 6 steps of 4 = one epoch exactly; 5 steps of 5 cross an epoch boundary mid-batch.
    rows = np.concatenate([tb.batch(s, 4) for s in range(6)])
    assert sorted(rows[:, 0] // seq_len) == list(range(n_windows))
    assert np.array_equal(rows[:, 1:], rows[:, :-1] + 1)
    samples = np.concatenate([tb.batch(s, 5)[:, 0] // seq_len for s in range(10)])
    assert np.array_equal(samples[:24], rows[:, 0] // seq_len)
    assert sorted(samples[24:48]) == list(range(n_windows))
    assert not np.array_equal(samples[:24], samples[24:48])  # a fresh order per epoch


def test_token_files(tmp_path):
    data = (np.arange(1000) % 300).astype(np.uint16)
    data.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", data.astype(np.int32))
    data.astype(np.uint32).tofile(tmp_path / "t.u32")
    for name in ("t.bin", "t.npy", "t.u32"):
        toks = load_tokens(str(tmp_path / name))
        assert np.array_equal(toks, data)
        x = TokenBatches(toks, 16, 0, vocab_size=300).batch(2, 4)
        assert x.shape == (4, 17)
        with pytest.raises(DataError) as e:
            TokenBatches(toks, 16, 0, vocab_size=256).batch(0, 60)  # every window, ids up to 299
        assert e.value.field == "data.path" and "299" in str(e.value)


def test_bad_paths(tmp_path):
    with pytest.raises(DataError) as e:
        load_tokens(str(tmp_path / "missing.bin"))
    assert e.value.field == "data.path" and "\n" not in str(e.value)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="no tokens"):
        load_tokens(str(tmp_path / "empty.bin"))
    np.save(tmp_path / "f.npy", np.zeros(4, np.float32))
    with pytest.raises(DataError, match="integer"):
        load_tokens(str(tmp_path / "f.npy"))
    (tmp_path / "a.txt").write_text("hi")
    with pytest.raises(DataError) as e:
        load_tokens(str(tmp_path / "a.txt"), tokenizer="gpt2")
    assert e.value.field == "data.tokenizer"


def test_text_file_and_directory(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"hello world")
    assert load_tokens(str(tmp_path / "one.txt")).tobytes() == b"hello world"
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_bytes(b"BBB")
    (d / "sub" / "c.py").write_bytes(b"CCC")
    (d / "a.rst").write_bytes(b"AAA")
    (d / "skip.bin").write_bytes(b"\x00\x01")
    toks = load_tokens(str(d))
    assert toks.dtype == np.uint8
    assert toks.tobytes() == b"AAA\n\nBBB\n\nCCC\n\n"


def test_small_corpus_and_bad_batch():
    with pytest.raises(DataError) as e:
        TokenBatches(np.arange(8, dtype=np.uint16), seq_len=8, seed=0, vocab_size=256)
    assert e.value.field == "train.seq_len"
    tb = TokenBatches(np.arange(9, dtype=np.uint16), seq_len=8, seed=0, vocab_size=256)
    assert tb.num_windows == 1 and tb.batch(5, 2).shape == (2, 9)
    with pytest.raises(DataError) as e:
        tb.batch(0, 6, 0, 4)
    assert e.value.field == "train.global_batch"
