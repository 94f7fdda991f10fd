"""Multi-host for real: several OS processes on localhost, one jax.distributed job (gloo).

* 2 processes x 4 devices and 4 processes x 2 devices give the 1-device losses;
* a checkpoint written by 2 processes resumes in 1 process and in 4;
* only process 0 writes metrics and prints steps;
* kill -9 one process: every other one exits non-zero within 60 s, naming it, and so does
  the launcher;
* SIGTERM: every process saves the same step and exits 0, and the run resumes from it.

Each job is started by `launch/local.sh` in a session of its own, under a deadline after which
the whole session is killed: nothing can hang CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import SMALL, env_without_devices, max_rel_diff, train_losses
from spmd3d import config
from spmd3d.train import train

REPO = Path(__file__).resolve().parent.parent
LOCAL = REPO / "launch" / "local.sh"
# a decay horizon apart from train.steps, so a 6-step run and an 8-step run share the schedule;
# checkpoints only at the end; a lost process is noticed after 10 s
COMMON = ["optim.decay_steps=50", "checkpoint.every=0", "dist.heartbeat_timeout_s=10"]
TWO_BY_FOUR = ["mesh.data=2", "mesh.stage=2", "mesh.tensor=2", "mesh.seq=1", "train.microbatches=2"]
# 2 devices per host cannot hold tensor 2 x seq 2: tensor crosses hosts, on purpose
FOUR_BY_TWO = ["mesh.data=2", "mesh.stage=1", "mesh.tensor=2", "mesh.seq=2",
               "mesh.allow_cross_host=true"]
DEADLINE_S = 240


def _env():
    env = env_without_devices()  # each process sets its own device count
    env.update(PYTHON=sys.executable, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return env


def local_job(n: int, devices: int, run_dir: Path, *overrides: str) -> str:
    """`launch/local.sh n` on the small model; returns its (prefixed) output."""
    argv = ["bash", str(LOCAL), str(n), *SMALL, *COMMON, f"mesh.simulated_devices={devices}",
            f"run.dir={run_dir}", *overrides]
    proc = subprocess.Popen(argv, env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every process it started
        out, _ = proc.communicate()
        pytest.fail(f"still running after {DEADLINE_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


@contextmanager
def background_job(argv: list[str], log: Path, env: dict | None = None):
    """A job writing to `log` (a file, not a pipe: nothing blocks on a full pipe), its whole
    session killed on the way out if it still runs."""
    with log.open("w") as out:
        job = subprocess.Popen(argv, env=env or _env(), cwd=REPO, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield job
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def wait_for_line(job, log: Path, pattern: str) -> None:
    start = time.monotonic()
    while not re.search(pattern, log.read_text(), re.M):
        assert time.monotonic() - start < DEADLINE_S and job.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)


def exit_status_within(job, log: Path, seconds: float, after: str) -> int:
    try:
        return job.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {seconds} s after {after}:\n" + log.read_text()[-3000:])


def losses(run_dir: Path) -> tuple[list[int], np.ndarray]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "event" not in r]  # a resize's record (2 -> 1, 2 -> 4)
    return [r["step"] for r in records], np.array([r["loss"] for r in records])


@pytest.fixture(scope="module")
def reference():
    """Losses of 8 steps on one device, in this process."""
    cfg = config.load(None, SMALL + COMMON + ["mesh.data=1", "mesh.tensor=1"])
    return train_losses(cfg, steps=8)[0]


def test_two_processes_match_one_device_and_their_checkpoint_resumes_on_1_and_4(
        tmp_path, reference):
    run = tmp_path / "two"
    out = local_job(2, 4, run, *TWO_BY_FOUR, "train.steps=6")
    steps, got = losses(run)
    assert steps == [1, 2, 3, 4, 5, 6]  # one record per step: only process 0 writes
    assert max_rel_diff(got, reference[:6]) < 1e-4, (got, reference[:6])
    assert "[0] step 6/6" in out and not re.search(r"^\[1\] step", out, re.M), out[-3000:]
    assert "[1] process 1 of 2 (config)" in out
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "6").is_dir()

    four = tmp_path / "four"
    shutil.copytree(run, four)

    # one process, one device, in this process: steps 7 and 8 from the 2-process checkpoint
    cfg = config.load(None, SMALL + COMMON + ["mesh.data=1", "mesh.tensor=1", "train.steps=8",
                                              f"run.dir={run}"])
    more = train(cfg, devices=jax.devices()[:1])
    assert [r["step"] for r in more] == [7, 8]
    assert max_rel_diff([r["loss"] for r in more], reference[6:]) < 1e-4

    # four processes of two devices each
    local_job(4, 2, four, *FOUR_BY_TWO, "train.steps=8")
    steps, got = losses(four)
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # appended to the 2-process run's records
    assert max_rel_diff(got[6:], reference[6:]) < 1e-4, (got, reference)


def test_four_processes_match_one_device(tmp_path, reference):
    run = tmp_path / "four"
    local_job(4, 2, run, *FOUR_BY_TWO, "train.steps=6")
    steps, got = losses(run)
    assert steps == [1, 2, 3, 4, 5, 6]
    assert max_rel_diff(got, reference[:6]) < 1e-4, (got, reference[:6])


def test_a_killed_process_stops_the_others_with_its_name(tmp_path):
    """`launch/local.sh 3` (1 device each); kill -9 process 1 mid-run: processes 0 (the
    coordinator) and 2 exit non-zero within 60 s, each saying that process 1 was lost, and
    the launcher exits non-zero. (Its grace before SIGKILL is raised above the heartbeat
    timeout here, so that the processes stop on their own.)"""
    log = tmp_path / "job.log"
    argv = ["bash", str(LOCAL), "3", *SMALL, *COMMON, "mesh.simulated_devices=1", "mesh.data=3",
            "mesh.tensor=1", "train.global_batch=12", "parallel.zero_stage=0",
            "train.steps=100000", f"run.dir={tmp_path / 'run'}"]
    with background_job(argv, log, {**_env(), "SPMD3D_KILL_GRACE_S": "50"}) as job:
        wait_for_line(job, log, r"^\[0\] step +3/")
        victim = subprocess.run(["pgrep", "-P", str(job.pid), "-f", "dist.process_id=1 "],
                                capture_output=True, text=True).stdout.split()
        assert len(victim) == 1, victim
        os.kill(int(victim[0]), signal.SIGKILL)  # no chance to say goodbye
        killed = time.monotonic()
        rc = exit_status_within(job, log, 60, "the kill")
        took = time.monotonic() - killed
        text = log.read_text()
        assert rc != 0, text[-3000:]
        assert "local.sh: process 1 exited with status 137" in text
        for i in (0, 2):
            status = re.search(rf"^local.sh: process {i} exited with status (\d+)$", text, re.M)
            line = re.search(rf"^\[{i}\] error: lost process 1 \(.*?\) of 3: [^\n]*", text, re.M)
            assert status and int(status.group(1)) != 0 and line, (i, text[-3000:])
            print(f"{line.group(0)} (exit {status.group(1)})")
        print(f"launcher: exit {rc}, {took:.1f} s after the kill")


def test_sigterm_stops_every_process_at_one_saved_step_and_the_run_resumes(tmp_path):
    """SIGTERM to the launcher (as a scheduler would send it) reaches both processes; jax's
    preemption service makes them stop after the same step, save it (each its own shards: the
    step is complete and restorable only if both did) and exit 0. A rerun resumes after it."""
    run = tmp_path / "run"
    log = tmp_path / "job.log"
    job_args = [*SMALL, *COMMON, "mesh.simulated_devices=1", "mesh.data=2", "mesh.tensor=1",
                f"run.dir={run}"]
    with background_job(["bash", str(LOCAL), "2", *job_args, "train.steps=100000"], log) as job:
        wait_for_line(job, log, r"^\[0\] step +3/")
        job.send_signal(signal.SIGTERM)
        rc = exit_status_within(job, log, 60, "SIGTERM")
    text = log.read_text()
    assert rc == 0, text[-3000:]
    saved = re.findall(r"^\[0\] preempted: saved step (\d+);", text, re.M)  # process 0 speaks
    assert len(saved) == 1, text[-3000:]
    step = int(saved[0])
    assert step >= 3 and losses(run)[0][-1] == step
    assert max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == step

    out = local_job(2, 1, run, "mesh.data=2", "mesh.tensor=1", f"train.steps={step + 1}")
    assert re.search(rf"^\[0\] step +{step + 1}/{step + 1}", out, re.M), out[-3000:]
    assert losses(run)[0][-2:] == [step, step + 1]
