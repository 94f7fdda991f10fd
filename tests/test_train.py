"""End to end: `train()` writes config, metrics and checkpoints, and resumes where it stopped."""

import json

import numpy as np
import yaml

from helpers import SMALL
from spmd3d import config, generate
from spmd3d.train import main, train


def cfg_in(run_dir, *extra):
    # a fixed decay horizon so that the schedule does not depend on train.steps
    return config.load(None, SMALL + ["mesh.tensor=1", "optim.decay_steps=50", f"run.dir={run_dir}",
                                      "checkpoint.every=2", *extra])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_dir_layout_and_resume_across_meshes(tmp_path):
    full = tmp_path / "full"
    ref = train(cfg_in(full, "train.steps=6", "mesh.data=8"))
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5, 6]
    assert ref[-1]["loss"] < ref[0]["loss"]

    run = tmp_path / "resumed"
    train(cfg_in(run, "train.steps=4", "mesh.data=8"))
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"} <= r.keys()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["mesh"]["data"] == 8 and saved["train"]["steps"] == 4
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [2, 4]

    # resume on another mesh and ZeRO stage: the canonical layout restores onto it
    more = train(cfg_in(run, "train.steps=6", "mesh.data=2", "mesh.tensor=4",
                        "parallel.zero_stage=3"))
    assert [r["step"] for r in more] == [5, 6]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]  # appended
    got = np.array([r["loss"] for r in more])
    want = np.array([r["loss"] for r in ref[4:]])
    assert np.max(np.abs(got - want) / want) < 1e-4, (got, want)


def test_explain_prints_where_parameters_live(tmp_path, capsys):
    argv = SMALL + ["train.steps=1", f"run.dir={tmp_path}", "mesh.data=2", "mesh.tensor=4",
                    "parallel.zero_stage=3", "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("blocks/mlp/w_down"))
    # (layers, mlp, embed) stored as (stage, tensor, data): local shape [2, 256/4, 128/2]
    assert "('layers', 'mlp', 'embed')" in row and "('stage', 'tensor', 'data')" in row
    assert "(2, 64, 64)" in row


def test_circular_pipeline_checkpoint_is_canonical(tmp_path):
    """Saved from a circular pipeline (stored layer order permuted), resumed without one."""
    L4 = ["model.num_layers=4", "train.microbatches=2"]
    ref = train(cfg_in(tmp_path / "ref", "train.steps=4", "mesh.data=8", *L4))
    run = tmp_path / "run"
    train(cfg_in(run, "train.steps=2", "mesh.data=2", "mesh.stage=2", "mesh.tensor=2",
                 "parallel.pipeline_repeats=2", "run.sample_every=2", "run.sample_tokens=12",
                 *L4))
    # the sample taken from the pipeline's layout is what the checkpoint generates on one device
    sample = json.loads((run / "samples.jsonl").read_text())
    plan, graphdef, params, tok = generate.load(run, ["mesh.simulated_devices=0"])
    one = generate.Generator(plan, graphdef, params, generate.TEMPERATURE, generate.TOP_P)
    new = one.generate([tok.encode("def")], 12)[0]
    assert sample == {"step": 2, "text": "def" + tok.decode(new)}
    more = train(cfg_in(run, "train.steps=4", "mesh.data=8", *L4))
    got = np.array([r["loss"] for r in more])
    want = np.array([r["loss"] for r in ref[2:]])
    assert np.max(np.abs(got - want) / want) < 1e-4, (got, want)


def test_clip_norm_toggles_across_a_resume(tmp_path):
    """Clipping on or off changes the optax chain, not the checkpoint's keys: a run resumes
    across the switch, both ways, from exactly the parameters it saved."""
    clip = ["optim.clip_norm=1.0"]
    ref = train(cfg_in(tmp_path / "ref", "train.steps=3", "mesh.data=8", *clip))
    run = tmp_path / "run"
    train(cfg_in(run, "train.steps=2", "mesh.data=8", *clip))
    off = train(cfg_in(run, "train.steps=3", "mesh.data=8", "optim.clip_norm=0"))
    # step 3's loss is computed before its update: the restored parameters alone decide it
    assert [r["step"] for r in off] == [3]
    assert abs(off[0]["loss"] - ref[2]["loss"]) <= 1e-6 * ref[2]["loss"], (off, ref)
    on = train(cfg_in(run, "train.steps=4", "mesh.data=8", *clip))
    assert [r["step"] for r in on] == [4] and np.isfinite(on[0]["loss"])
