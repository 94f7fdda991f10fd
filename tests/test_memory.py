"""A step that cannot fit is refused before its first step; one that runs out of memory anyway
ends with one line and leaves the checkpoints as they were."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SMALL, small_config
from spmd3d import memory
from spmd3d.api import Experiment

ROOT = Path(__file__).resolve().parent.parent
# a tiny model, a huge sequence: blocked attention's scores alone need ~70 GB at once
HUGE_SEQ = ["model.num_layers=1", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=4",
            "model.d_ff=128", "train.seq_len=65536", "train.global_batch=1", "mesh.data=1",
            "mesh.tensor=1"]


def train_command(run_dir, *overrides):
    return [sys.executable, "-m", "spmd3d.train", *SMALL, f"run.dir={run_dir}", *overrides]


def run(args, **env):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_step_that_cannot_fit_is_refused_in_one_line(tmp_path):
    """Exit 2 after compiling, nothing allocated (no checkpoint, no metrics), no traceback; the
    line names the largest kind and what to change."""
    out = run(train_command(tmp_path / "run", "mesh.simulated_devices=1", *HUGE_SEQ))
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    line = lines[0]
    assert line.startswith("error: memory: this layout needs "), line
    assert "mostly activations at seq_len 65536" in line and "a device has" in line, line
    assert "mesh.seq" in line and "train.seq_len" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_check_in_the_api_and_its_switch():
    """`Experiment` raises the same error; `run.memory_check=false` compiles without it; a
    layout that fits passes and says what it needs."""
    huge = small_config(extra=HUGE_SEQ)
    with pytest.raises(memory.DoesNotFit, match="mostly activations"):
        Experiment(huge).compile()
    unchecked = small_config(extra=HUGE_SEQ + ["run.memory_check=false"])
    Experiment(unchecked).compile()  # compiles; allocates nothing
    fits = Experiment(small_config())
    fits.compile()
    need = fits.job.need
    assert 0 < need["total"] <= need["limit"] and need["limit_source"]


def tree_digest(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_out_of_memory_at_run_time_is_one_line_and_keeps_the_checkpoint(tmp_path):
    base = ["mesh.simulated_devices=2", "mesh.data=2", "mesh.tensor=1", "checkpoint.every=2"]
    first = run(train_command(tmp_path / "run", *base, "train.steps=2"))
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    before = tree_digest(checkpoints)
    assert before
    out = run(train_command(tmp_path / "run", *base, "train.steps=6"),
              **{memory.FAKE_OOM_ENV: "3"})
    assert out.returncode == 1, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[0].startswith("error: out of memory at step 3: the device could not allocate "
                               "68.7 GB; the compiled step needs "), lines[0]
    assert tree_digest(checkpoints) == before
