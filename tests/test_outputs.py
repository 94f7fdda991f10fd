"""What a run leaves besides checkpoints: held-out loss, TensorBoard events, the picture of its
curves, and one line for each kind of bad input."""

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import devices_for, max_rel_diff, small_config
from spmd3d import config, runtime
from spmd3d.train import train

ROOT = Path(__file__).resolve().parent.parent


def held_out_loss(**layout):
    c = small_config(**layout)
    job = runtime.setup(c, devices_for(c))
    return job.evaluate(job.init_state().params)


def test_eval_loss_is_the_same_on_any_mesh():
    one = held_out_loss()
    assert 4 < one < 7  # about log(256) at the initial weights
    assert max_rel_diff([held_out_loss(data=2, tensor=2, seq=2)], [one]) < 1e-5


def test_training_and_held_out_windows_never_overlap(tmp_path):
    """A corpus of distinct tokens: every token any training batch of a whole epoch reads, and
    every token of the fixed held-out batches, come from disjoint sets."""
    path = tmp_path / "distinct.npy"
    np.save(path, np.arange(4096, dtype=np.uint16))
    c = small_config(extra=[f"data.path={path}", "model.vocab_size=4096", "train.global_batch=4",
                            "run.eval_batches=2", "data.eval_fraction=0.1"])
    job = runtime.setup(c, devices_for(c))
    per_epoch = -(-job.batches.num_windows // 4)
    seen = {int(t) for s in range(per_epoch) for t in job.batches.batch(s, 4).ravel()}
    held = {int(t) for k in range(2) for t in job.evals.batch(k, 4).ravel()}
    assert seen and held and not seen & held
    assert max(seen) < min(held) and len(seen) > 3000


def read_events(logdir: Path) -> dict:
    """{tag: [(step, value)]} from TensorBoard event files (TFRecords of Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in logdir.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "small"
    c = small_config(extra=["train.steps=4", "run.eval_every=2", "run.tensorboard=true",
                            f"run.dir={run_dir}"])
    return run_dir, train(c, devices=devices_for(c))


def test_eval_loss_every_n_steps_and_tensorboard_events(finished_run):
    run_dir, records = finished_run
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    r = records[-1]
    assert r["eval_perplexity"] == pytest.approx(np.exp(r["eval_loss"]))
    events = read_events(run_dir / "tensorboard")
    for tag in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s",
                "memory_per_device_gb"):
        assert tag in events, (tag, sorted(events))
    assert [s for s, _ in events["loss"]] == [1, 2, 3, 4]
    assert events["eval_loss"][-1] == (4, pytest.approx(r["eval_loss"], rel=1e-6))


def png_pixels(path: Path) -> np.ndarray:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path)


def test_a_run_draws_its_curves_and_plot_overlays_runs(finished_run, tmp_path):
    run_dir, _ = finished_run
    own = png_pixels(run_dir / "curves.png")
    assert own.shape[0] > 300 and own.shape[1] > 600 and own.std() > 0.05
    out = tmp_path / "two.png"
    done = subprocess.run([sys.executable, "-m", "spmd3d.plot", str(run_dir), str(run_dir),
                           f"--out={out}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert png_pixels(out).std() > 0.05


@pytest.mark.parametrize("overrides, field", [
    (["data.eval_fraction=1.5"], "data.eval_fraction"),
    (["data.eval_fraction=-0.1"], "data.eval_fraction"),
    (["data.eval_fraction=0"], "run.eval_every"),  # evaluation asked for, nothing held out
    (["run.eval_batches=0"], "run.eval_batches"),
])
def test_bad_evaluation_settings_are_config_errors(overrides, field):
    with pytest.raises(config.ConfigError) as e:
        small_config(extra=overrides)
    assert e.value.field == field


def one_line_exit_2(args, needle):
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr[-2000:]


def test_more_eval_batches_than_held_out_windows_exit_2(tmp_path):
    one_line_exit_2(["-m", "spmd3d.train", "mesh.simulated_devices=1", "mesh.data=1",
                     "mesh.tensor=1", "data.eval_fraction=0.0001", f"run.dir={tmp_path}"],
                    "error: data.eval_fraction: the held-out data has")


def test_plot_of_a_directory_without_metrics_exit_2(tmp_path):
    one_line_exit_2(["-m", "spmd3d.plot", str(tmp_path)], "error: RUN_DIR: ")
