"""Checkpoints that survive anything: another mesh, kill -9, SIGTERM, damage, another model.

In-process runs use the 8 simulated devices of this pytest process; the crash tests run
`python -m spmd3d.train` as a real OS process (2 simulated devices) and kill it.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import SMALL, devices_for, max_rel_diff, small_config, train_losses
import spmd3d
from spmd3d import config
from spmd3d.checkpoint import TMP_MARK, info, load
from spmd3d.train import main, train

# four layers so that stage = 4 splits them; a decay horizon that does not depend on train.steps
BASE = ["model.num_layers=4", "optim.decay_steps=12", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def reference():
    """Losses of 12 uninterrupted steps on one device."""
    losses, _, _ = train_losses(small_config(extra=BASE + ["train.steps=12"]))
    return losses


def run_cfg(run_dir, steps, data=1, stage=1, tensor=1, seq=1, zero=0, micro=1):
    return small_config(data, stage, tensor, seq, zero=zero, micro=micro,
                        extra=BASE + [f"train.steps={steps}", f"run.dir={run_dir}"])


def read_metrics(run_dir):
    """{step: loss}, the last record of each step (a restarted run logs some steps again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # the line a running process is writing
            continue
        out[r["step"]] = r["loss"]
    return out


def test_resume_onto_other_meshes_zero_stages_and_pipelines(tmp_path, reference):
    """2x2x2x1 ZeRO-1 (a pipeline) -> 1x1x4x2 ZeRO-3 (TP + ring) -> 1x4x1x1 (4 stages): every
    resumed step has the loss of the uninterrupted 1-device run."""
    run = tmp_path / "run"
    legs = [run_cfg(run, 4, data=2, stage=2, tensor=2, zero=1, micro=2),
            run_cfg(run, 8, tensor=4, seq=2, zero=3),
            run_cfg(run, 12, stage=4, micro=4)]
    for leg in legs:
        records = train(leg, devices=devices_for(leg))
        steps = [r["step"] for r in records]
        assert steps == list(range(steps[0], steps[0] + 4)), steps
        got = [r["loss"] for r in records]
        assert max_rel_diff(got, reference[steps[0] - 1: steps[-1]]) < 1e-4, (got, reference)
    rows = info(run)
    assert [r["step"] for r in rows] == [8, 10, 12]  # keep = 3
    assert rows[-1]["mesh"] == {"data": 1, "stage": 4, "tensor": 1, "seq": 1}


# ------------------------------------------------------------------------ real processes, killed
def last_logged(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    try:
        return json.loads(lines[-1])["step"]
    except ValueError:
        return json.loads(lines[-2])["step"]


def command(run_dir, steps=10, every=3):
    args = SMALL + BASE + ["mesh.simulated_devices=2", "mesh.data=2", "mesh.tensor=1", f"train.steps={steps}",
                           f"checkpoint.every={every}", f"run.dir={run_dir}"]
    return [sys.executable, "-m", "spmd3d.train", *args]


def start(run_dir, log_name):
    log = open(run_dir.parent / f"{log_name}.log", "w")
    proc = subprocess.Popen(command(run_dir), stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log.name
    return proc


def output(proc):
    with open(proc.log_path) as f:
        return f.read()


def wait_for(predicate, proc, timeout=240.0, poll=0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    proc.kill()
    raise AssertionError(f"timed out; output so far:\n{output(proc)}")


def saving(ckpt_dir):
    """Names of the unfinished (being written) step directories."""
    try:
        return [n for n in os.listdir(ckpt_dir) if TMP_MARK in n]
    except FileNotFoundError:
        return []


def committed(ckpt_dir):
    try:
        return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
    except FileNotFoundError:
        return []


def resumed_at(proc):
    return int(re.search(r"resumed at step (\d+)", output(proc)).group(1))


def test_sigterm_and_kill9_lose_nothing(tmp_path, reference):
    """SIGTERM: the step in flight is finished and saved, exit 0. kill -9 during a save and during
    training: the newest complete checkpoint is used and the half-written one is never picked up.
    After all that, every step's loss equals the uninterrupted run's."""
    run = tmp_path / "run"
    run.mkdir()
    ckpt_dir = run / "checkpoints"

    # 1. SIGTERM once the first step is logged: saves the step it stops at (every=3: off-schedule)
    proc = start(run, "sigterm")
    wait_for(lambda: (run / "metrics.jsonl").exists() and read_metrics(run), proc)
    assert proc.poll() is None, output(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, output(proc)
    stopped = max(read_metrics(run))
    assert f"preempted: saved step {stopped};" in output(proc)
    assert committed(ckpt_dir) == [stopped]
    assert stopped < 10

    # 2. kill -9 while a checkpoint is being written (a temp dir exists after the kill)
    for attempt in range(3):
        proc = start(run, f"kill-save-{attempt}")
        before = committed(ckpt_dir)
        wait_for(lambda: saving(ckpt_dir) and max(read_metrics(run)) > before[-1], proc)
        proc.kill()
        proc.wait(timeout=60)
        if saving(ckpt_dir):  # else the save committed between the look and the kill: again
            break
    else:
        pytest.fail("could not catch a save in progress in 3 attempts")
    assert resumed_at(proc) == stopped
    half = saving(ckpt_dir)[0]
    newest = committed(ckpt_dir)[-1]
    assert int(half.split(".")[0]) > newest
    rows = info(run)
    assert [(r["step"], r["complete"]) for r in rows if not r["complete"]] == [
        (int(half.split(".")[0]), False)]

    # 3. restart; once it has saved a new step and trained past it, kill -9 between saves
    proc = start(run, "kill-train")
    wait_for(lambda: "resumed at step" in output(proc), proc)
    assert resumed_at(proc) == newest  # the half-written step was not picked up
    wait_for(lambda: committed(ckpt_dir)[-1] > newest and not saving(ckpt_dir)
             and last_logged(run) > committed(ckpt_dir)[-1], proc)
    proc.kill()
    proc.wait(timeout=60)
    newest = committed(ckpt_dir)[-1]
    assert last_logged(run) > newest

    # 4. the same command finishes the run
    proc = start(run, "finish")
    assert proc.wait(timeout=300) == 0, output(proc)
    assert resumed_at(proc) == newest
    assert not saving(ckpt_dir)  # a training run clears what killed runs left
    losses = read_metrics(run)
    assert sorted(losses) == list(range(1, 11))
    got = [losses[s] for s in range(1, 11)]
    assert max_rel_diff(got, reference[:10]) < 1e-4, (got, reference[:10])


# --------------------------------------------------------------------- wrong or damaged checkpoints
def tree_digest(path):
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def exit_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_wrong_model_and_damaged_step_exit_2_and_touch_nothing(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    argv = SMALL + ["mesh.data=8", "mesh.tensor=1", f"run.dir={run}", "checkpoint.every=2", "optim.decay_steps=12"]
    first = {r["step"]: r["loss"] for r in train(config.load(None, argv + ["train.steps=4"]))}
    ckpt_dir = run / "checkpoints"
    good = tree_digest(ckpt_dir)

    # another model is refused from the checkpoint's metadata, before the step is compiled
    with monkeypatch.context() as patched:
        patched.setattr(spmd3d.runtime.Job, "compile", lambda job: pytest.fail("compiled"))
        for override, field in [("model.num_layers=4", "model.num_layers"),
                                ("model.vocab_size=512", "model.vocab_size"),
                                ("model.d_model=64", "model.d_model")]:
            line = exit_line(argv + ["train.steps=6", override], capsys)
            assert line.startswith(f"error: {field}: checkpoint step 4 in "), line
            assert "was written with" in line
            assert tree_digest(ckpt_dir) == good

    # damage step 4: one flipped byte (read fine, caught by the fingerprint), then a cut file
    blobs = sorted((ckpt_dir / "4" / "state").rglob("d/*"), key=lambda f: -f.stat().st_size)
    original = blobs[0].read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 3] ^= 0x08
    for damage in (bytes(flipped), original[: len(original) // 2]):
        blobs[0].write_bytes(damage)
        damaged = tree_digest(ckpt_dir)
        line = exit_line(argv + ["train.steps=6"], capsys)
        assert line.startswith("error: checkpoint: ") and "step 4 is damaged" in line, line
        assert "newest step before it is 2" in line and "checkpoint.fallback=true" in line, line
        assert tree_digest(ckpt_dir) == damaged  # nothing moved, step 2 untouched

    out = subprocess.run([sys.executable, "-m", "spmd3d.checkpoint", "info", str(run), "--verify"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {int(line.split()[0]): line for line in out.stdout.splitlines()[1:]}
    assert rows.keys() == {2, 4}
    assert rows[2].split()[1] == "complete" and rows[2].endswith(" ok")
    assert "8x1x1x1, ZeRO-" in rows[2] and "damaged" not in rows[2]
    assert not rows[4].endswith(" ok")

    # asked for: step 4 is moved aside (kept), the run resumes from step 2 and matches
    assert main(argv + ["train.steps=4", "checkpoint.fallback=true"]) == 0
    assert "moved to" in capsys.readouterr().out
    assert [p.name.split("-")[0] for p in (tmp_path / "run" / "checkpoints.damaged").iterdir()] == ["4"]
    again = read_metrics(run)
    assert max_rel_diff([again[3], again[4]], [first[3], first[4]]) < 1e-6


def test_load_params_for_a_notebook(tmp_path):
    """One call: the parameters as a nested dict, on one device or with a mesh's shardings."""
    run = tmp_path / "run"
    cfg = run_cfg(run, 2, data=2, tensor=4, zero=3)
    train(cfg, devices=devices_for(cfg))
    params, meta = load(run)
    assert meta["step"] == 2 and meta["mesh"]["tensor"] == 4
    w = params["blocks"]["mlp"]["w_down"]
    assert w.shape == (4, 256, 128) and len(w.sharding.device_set) == 1

    mesh = jax.make_mesh((1, 1, 2, 1), ("data", "stage", "tensor", "seq"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4, devices=jax.devices()[:2])
    sharded, _ = spmd3d.load(run, mesh=mesh)
    ws = sharded["blocks"]["mlp"]["w_down"]
    assert ws.sharding.mesh.shape["tensor"] == 2
    assert ws.addressable_shards[0].data.shape == (4, 128, 128)  # [layers, mlp/2, embed]
    np.testing.assert_array_equal(np.asarray(ws), np.asarray(w))
    moments, _ = load(run, what="opt")
    assert "params" not in moments and len(jax.tree.leaves(moments)) > 0


def test_checkpoint_of_an_older_key_schema_exits_2_and_is_kept(tmp_path, capsys):
    run = tmp_path / "run"
    argv = SMALL + ["mesh.data=8", "mesh.tensor=1", f"run.dir={run}"]
    assert main(argv + ["train.steps=1"]) == 0
    meta_file = run / "checkpoints" / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["schema"] == 2
    meta_file.write_text(json.dumps({**meta, "schema": 1}))
    before = tree_digest(run / "checkpoints")
    line = exit_line(argv + ["train.steps=2"], capsys)
    assert line.startswith("error: checkpoint: ") and "has key schema 1" in line, line
    assert "reads schema 2" in line
    assert tree_digest(run / "checkpoints") == before
