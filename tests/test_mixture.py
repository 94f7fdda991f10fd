"""Sources mixed by weight (`data.mixture`): each source's share within 1 % of its weight, the
batch of a step a pure function of the step (any process count), a mixed run resumed exactly,
and bad weights refused with one line."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import SMALL
from spmd3d import config
from spmd3d.data import DataError, TokenBatches
from spmd3d.data.mixture import BLOCK, Mixture, quotas
from spmd3d.parsing import parse_mixture
from spmd3d.schema import ConfigError
from spmd3d.train import train

WEIGHTS = [0.55, 0.3, 0.15]


def sources(seq_len=8, windows=(37, 50, 23)):
    """Source i: `windows[i]` windows whose tokens are i * 50 + their window number."""
    out = []
    for i, n in enumerate(windows):
        tokens = np.repeat(i * 50 + np.arange(n + 1), seq_len)[:n * seq_len + 1]
        out.append(TokenBatches(tokens.astype(np.uint16), seq_len, 0, 256, i))
    return out


def test_each_source_gets_its_share_and_walks_its_own_windows():
    """Over 10,000 windows and over 10,500 (not whole blocks), each source's share is within
    1 % of its weight; a source's windows come in its own per-epoch permutation (each once
    per epoch)."""
    mix = Mixture(sources(), WEIGHTS, seed=3)
    for steps in (100, 105):
        rows = np.concatenate([mix.batch(s, 100) for s in range(steps)])
        share = np.bincount(rows[:, 0] // 50, minlength=3) / len(rows)
        assert np.all(np.abs(share - WEIGHTS) <= 0.01 * np.asarray(WEIGHTS)), share
    first = rows[:, 0]
    from_1 = first[first // 50 == 1][:50]  # source 1's first epoch: each of its 50 windows once
    assert sorted(from_1 % 50) == list(range(50))
    assert quotas([1, 1, 1]).tolist() == [334, 333, 333] and quotas([2, 0]).sum() == BLOCK


def test_a_steps_batch_is_the_same_whatever_the_processes():
    """Two processes' rows, concatenated, are one process's; a fresh mixture gives them again."""
    one = Mixture(sources(), WEIGHTS, seed=3).batch(7, 64)
    again = Mixture(sources(), WEIGHTS, seed=3)
    halves = [again.batch(7, 64, p, 2) for p in (0, 1)]
    assert np.array_equal(np.concatenate(halves), one)
    assert not np.array_equal(Mixture(sources(), WEIGHTS, seed=4).batch(7, 64), one)


def test_a_mixed_run_resumes_exactly(tmp_path):
    """Two token files mixed 3:1, each with its held-out part: 4 steps straight, and 2 steps
    then 2 more from the checkpoint, give the same losses and held-out loss."""
    rng = np.random.default_rng(0)
    for name, low in (("a", 0), ("b", 128)):
        (low + rng.integers(0, 128, 6000)).astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    mix = f"data.mixture={tmp_path}/a.bin=3,{tmp_path}/b.bin=1"

    def run(name, steps):
        return train(config.load(None, SMALL + [
            "mesh.tensor=1", "mesh.data=8", "optim.decay_steps=50", f"run.dir={tmp_path / name}",
            "checkpoint.every=2", f"train.steps={steps}", "run.eval_every=2",
            "run.eval_batches=1", "run.sample_every=0", "data.eval_fraction=0.1", mix]))

    straight = run("straight", 4)
    run("resumed", 2)
    more = run("resumed", 4)
    assert [r["step"] for r in more] == [3, 4]
    for got, want in zip(more, straight[2:]):
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"]
    assert abs(more[-1]["eval_loss"] - straight[-1]["eval_loss"]) <= 1e-6 * more[-1]["eval_loss"]
    # `python -m spmd3d.data bench` reads the same data
    from spmd3d.data.__main__ import bench

    assert bench([mix, "train.seq_len=32", "train.global_batch=16"], steps=3)["tokens_per_s"] > 0


@pytest.mark.parametrize("spec,why", [
    ("a.bin=0.5,b.bin=-1", "negative"),
    ("a.bin=0,b.bin=0", "every weight is zero"),
    ("a.bin", "is not PATH=WEIGHT"),
    ("a.bin=x", "is not PATH=WEIGHT")])
def test_bad_weights_are_one_line(spec, why):
    with pytest.raises(DataError, match=why):
        parse_mixture(spec)
    with pytest.raises(ConfigError, match=f"data.mixture: .*{why}"):
        config.load(None, [f"data.mixture={spec}"])
