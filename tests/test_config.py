"""The configuration contract: parsing, overrides, validation and the exit-2 error path.

Every bad input must make `python -m spmd3d.train` exit with status 2 and print exactly one
line, `error: <field>: <message>`, on stderr, with no traceback (DESIGN.md, "The command-line
contract"). Most cases run `spmd3d.train.main` in-process: the ones that fail validation never
start jax, and the few that get further use tiny sizes and fail before any training step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd3d import cli
from spmd3d import config as config_lib
from spmd3d import train as train_lib
from spmd3d.config import Config, ConfigError

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

# Small sizes for cases that get past validation, so nothing heavy runs before they fail.
SMALL = ["model.num_layers=1", "model.d_model=64", "model.num_kv_heads=4", "train.seq_len=16",
         "train.global_batch=8", "train.steps=1", "mesh.simulated_devices=0"]


# ---------------------------------------------------------------------------------------------
# parsing

def test_defaults_equal_demo_yaml():
    defaults = config_lib.load()
    assert isinstance(defaults, Config)
    assert config_lib.to_dict(defaults) == config_lib.to_dict(Config())
    demo = config_lib.load(str(REPO / "configs" / "demo.yaml"))
    assert config_lib.to_dict(demo) == config_lib.to_dict(defaults)


@pytest.mark.parametrize("override, section, name, expected", [
    ("train.steps=5", "train", "steps", 5),
    ("optim.lr=1e-3", "optim", "lr", 1e-3),
    ("optim.lr=0.002", "optim", "lr", 0.002),
    ("optim.weight_decay=0", "optim", "weight_decay", 0.0),
    ("parallel.sequence_parallel=true", "parallel", "sequence_parallel", True),
    ("run.explain=false", "run", "explain", False),
    ("data.path=foo", "data", "path", "foo"),
    ("model.dtype=bfloat16", "model", "dtype", "bfloat16"),
    ("model.fp8=off", "model", "fp8", "off"),  # YAML 1.1 read `off` as False
    ("data.path=no", "data", "path", "no"),  # text as written, not a boolean's spelling
    ("parallel.sequence_parallel=yes", "parallel", "sequence_parallel", True),
    ("run.explain=off", "run", "explain", False),
    ("model.fp8=delayed", "model", "fp8", "delayed"),
])
def test_override_types(override, section, name, expected):
    cfg = config_lib.load(None, [override])
    value = getattr(getattr(cfg, section), name)
    assert value == expected
    assert type(value) is type(expected)


def test_override_order_and_file_then_overrides(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("train: {steps: 7, seq_len: 64}\nmodel: {num_layers: 2}\n")
    cfg = config_lib.load(str(cfg_file), ["train.steps=3", "train.steps=9"])
    assert (cfg.train.steps, cfg.train.seq_len, cfg.model.num_layers) == (9, 64, 2)
    assert cfg.model.d_model == Config().model.d_model  # untouched fields keep their defaults


def test_checkpoint_async_spelling():
    cfg = config_lib.load(None, ["checkpoint.async=false"])
    assert cfg.checkpoint.async_ is False
    d = config_lib.to_dict(cfg)
    assert d["checkpoint"]["async"] is False
    assert "async_" not in d["checkpoint"]
    # `async_` is not a YAML/command-line name
    with pytest.raises(ConfigError) as e:
        config_lib.load(None, ["checkpoint.async_=false"])
    assert e.value.field == "checkpoint.async_"


def test_to_dict_round_trips_through_yaml(tmp_path):
    import yaml

    cfg = config_lib.load(None, ["train.steps=5", "checkpoint.async=false", "optim.lr=1e-3"])
    path = tmp_path / "round.yaml"
    path.write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
    assert config_lib.load(str(path)) == cfg


def test_override_function():
    cfg = config_lib.override(Config(), model=dict(num_layers=2), checkpoint={"async": False})
    assert cfg.model.num_layers == 2 and cfg.checkpoint.async_ is False
    with pytest.raises(ConfigError) as e:
        config_lib.override(Config(), model=dict(num_kv_heads=3))
    assert e.value.field == "model.num_heads"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_loads(path):
    cfg = config_lib.load(str(path))
    assert isinstance(cfg, Config)


def test_parse_args():
    assert cli.parse_args(["c.yaml", "a.b=1", "--explain"]) == ("c.yaml", ["a.b=1"], ["--explain"])
    assert cli.parse_args([]) == (None, [], [])
    with pytest.raises(ConfigError) as e:
        cli.parse_args(["c.yaml", "stray"])
    assert e.value.field == "argv"


# ---------------------------------------------------------------------------------------------
# bad input -> exit 2, one line naming the field, no traceback

def _files(tmp_path: Path) -> dict[str, str]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: {num_layers: 2\ntrain: [unclosed\n")
    list_yaml = tmp_path / "list.yaml"
    list_yaml.write_text("- model\n- train\n")
    binary_yaml = tmp_path / "binary.yaml"
    binary_yaml.write_bytes(b"\xff\xfe\x00model: 1\n")
    big_ids = tmp_path / "big_ids.bin"
    np.random.default_rng(0).integers(0, 1001, size=4096, dtype=np.uint16).tofile(big_ids)
    return {"BAD_YAML": str(bad_yaml), "LIST_YAML": str(list_yaml),
            "BINARY_YAML": str(binary_yaml), "BIG_IDS": str(big_ids),
            "MISSING": str(tmp_path / "missing.yaml")}


# (id, argv, field the line must name). Placeholders in capitals are replaced by _files().
STATIC_CASES = [
    ("unknown-key", ["model.nope=1"], "model.nope"),
    ("unknown-section", ["nosuch.steps=1"], "nosuch"),
    ("section-not-a-mapping", ["model=3"], "model"),
    ("steps-not-int", ["train.steps=abc"], "train.steps"),
    ("bool-not-bool", ["parallel.sequence_parallel=maybe"], "parallel.sequence_parallel"),
    ("int-given-float", ["model.d_model=1.5"], "model.d_model"),
    ("float-not-float", ["optim.lr=fast"], "optim.lr"),
    ("str-given-list", ["data.path=[1, 2]"], "data.path"),
    ("steps-zero", ["train.steps=0"], "train.steps"),
    ("global-batch-negative", ["train.global_batch=-4"], "train.global_batch"),
    ("lr-zero", ["optim.lr=0"], "optim.lr"),
    ("zero-stage-5", ["parallel.zero_stage=5"], "parallel.zero_stage"),
    ("remat-bogus", ["parallel.remat=bogus"], "parallel.remat"),
    ("offload-1f1b", ["mesh.stage=2", "mesh.tensor=1", "parallel.remat=offload",
                      "parallel.pipeline_schedule=1f1b", "train.microbatches=2"], "parallel.remat"),
    ("replicate-not-div", ["mesh.data=6", "mesh.replicate=4", "mesh.tensor=1"], "mesh.data"),
    ("sigmoid-aux", ["model.num_experts=8", "model.router_score=sigmoid",
                     "model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef"),
    ("groups-too-few", ["model.num_experts=8", "model.experts_per_token=4",
                        "model.router_groups=4", "model.router_topk_groups=1"],
     "model.router_topk_groups"),
    ("dtype-int8", ["model.dtype=int8"], "model.dtype"),
    ("heads-not-div-kv", ["model.num_heads=4", "model.num_kv_heads=3"], "model.num_heads"),
    ("kv-not-div-tensor", ["model.num_heads=6", "model.num_kv_heads=3", "model.d_model=192"],
     "model.num_kv_heads"),
    ("dff-not-div-tensor", ["model.d_ff=767"], "model.d_ff"),
    ("vocab-not-div-tensor", ["model.vocab_size=257"], "model.vocab_size"),
    ("batch-not-div-data", ["mesh.data=4", "train.global_batch=6"], "train.global_batch"),
    ("batch-not-div-microbatches", ["train.global_batch=32", "train.microbatches=3"],
     "train.global_batch"),
    ("seq-not-div-tensor-sp", ["parallel.sequence_parallel=true", "train.seq_len=127"],
     "train.seq_len"),
    ("dmodel-not-div-data-zero", ["mesh.data=3", "mesh.tensor=1", "train.global_batch=30",
                                  "parallel.zero_stage=1"], "model.d_model"),
    # uneven stages are fine (4 layers on 3 stages), a stage without a layer is not
    ("layers-fewer-than-stages", ["mesh.stage=3", "model.num_layers=2"], "model.num_layers"),
    ("layers-fewer-than-stage-repeats", ["mesh.stage=2", "parallel.pipeline_repeats=4"],
     "model.num_layers"),
    ("repeats-without-pipeline", ["parallel.pipeline_repeats=2", "model.num_layers=4"],
     "parallel.pipeline_repeats"),
    ("circular-needs-microbatches", ["mesh.stage=2", "parallel.pipeline_repeats=2",
                                     "train.microbatches=1"], "train.microbatches"),
    ("schedule-bogus", ["mesh.stage=2", "parallel.pipeline_schedule=pipedream"],
     "parallel.pipeline_schedule"),
    ("1f1b-interleaved-groups", ["mesh.stage=4", "model.num_layers=8", "train.global_batch=24",
                                 "parallel.pipeline_repeats=2", "train.microbatches=6",
                                 "parallel.pipeline_schedule=1f1b"], "train.microbatches"),
    ("1f1b-zero3-tick", ["mesh.stage=2", "parallel.zero_stage=3", "parallel.zero3_gather=tick",
                         "parallel.pipeline_schedule=1f1b"], "parallel.zero3_gather"),
    ("zb-interleaved-groups", ["mesh.stage=4", "model.num_layers=8", "train.global_batch=24",
                               "parallel.pipeline_repeats=2", "train.microbatches=6",
                               "parallel.pipeline_schedule=zb_h1"], "train.microbatches"),
    ("pipeline-batch-not-div", ["mesh.stage=2", "train.microbatches=3"], "train.global_batch"),
    ("seq-len-not-div-zigzag", ["mesh.seq=4", "mesh.tensor=1", "train.seq_len=100"], "train.seq_len"),
    ("tensor-zero", ["mesh.tensor=0"], "mesh.tensor"),
    ("missing-config-file", ["MISSING"], "config"),
    ("invalid-yaml", ["BAD_YAML"], "config"),
    ("yaml-top-level-list", ["LIST_YAML"], "config"),
    ("yaml-top-level-list-with-override", ["LIST_YAML", "train.steps=1"], "config"),
    ("yaml-not-utf8", ["BINARY_YAML"], "config"),
    ("unknown-flag", ["--nope"], "argv"),
    ("stray-positional", [str(REPO / "configs" / "demo.yaml"), "stray"], "argv"),
    ("empty-key", ["=5"], "argv"),
]


def _substitute(argv, files):
    out = []
    for a in argv:
        for key, value in files.items():
            a = a.replace(key, value)
        out.append(a)
    return out


def _assert_one_error_line(rc, captured, field):
    assert rc == 2, f"exit status {rc}, stderr: {captured.err!r}"
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got {captured.err!r}"
    line = lines[0]
    assert line.strip() and line.startswith("error: "), line
    assert line.startswith(f"error: {field}: "), f"{line!r} does not name {field!r}"
    assert len(line) > len(f"error: {field}: "), "the message says nothing"


@pytest.mark.parametrize("argv, field", [c[1:] for c in STATIC_CASES],
                         ids=[c[0] for c in STATIC_CASES])
def test_bad_input_exits_2(argv, field, tmp_path, capsys):
    argv = _substitute(argv, _files(tmp_path)) + [f"run.dir={tmp_path / 'run'}"]
    rc = train_lib.main(argv)
    _assert_one_error_line(rc, capsys.readouterr(), field)
    assert not (tmp_path / "run").exists()  # rejected before anything was written


# Cases that pass the static checks and fail only once training has been set up:
# (id, argv, field, a word the message must contain).
LATE_CASES = [
    # data*stage*tensor*seq = 6 != 8 devices: only resolve_mesh (inside train) can tell.
    ("mesh-product", ["mesh.data=3", "mesh.tensor=2", "train.global_batch=12",
                      "parallel.zero_stage=0"], "mesh", "8 devices"),
    ("data-path-missing", ["data.path=/nonexistent/file.bin"], "data.path", "does not exist"),
    # byte-tokenizer vocab >= 256 is checked statically only for the default corpus; a token
    # file with ids up to 1000 is caught by the data loader.
    ("token-ids-exceed-vocab", ["data.path=BIG_IDS", "model.vocab_size=256"], "data.path",
     "vocab_size 256"),
    # FP8 GEMMs on CPU devices: refused when the plan meets the devices, emulation named
    ("fp8-off-hopper", ["model.fp8=delayed"], "model.fp8", "model.fp8_emulate=true"),
]


@pytest.mark.parametrize("argv, field, words", [c[1:] for c in LATE_CASES],
                         ids=[c[0] for c in LATE_CASES])
def test_late_bad_input_exits_2(argv, field, words, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = SMALL + _substitute(argv, _files(tmp_path)) + [f"run.dir={run_dir}"]
    config_lib.load(None, argv)  # passes the static checks: the error must come from train
    rc = train_lib.main(argv)
    captured = capsys.readouterr()
    _assert_one_error_line(rc, captured, field)
    assert words in captured.err, captured.err
    ckpts = run_dir / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir()), sorted(p.name for p in ckpts.iterdir())


# ---------------------------------------------------------------------------------------------
# the real command line (each starts an interpreter, so only two)

@pytest.mark.parametrize("argv, field", [
    (["model.nope=1"], "model.nope"),
    (["model.num_heads=4", "model.num_kv_heads=3"], "model.num_heads"),
], ids=["unknown-key", "kv-heads-not-divisible"])
def test_subprocess_exit_2(argv, field, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "spmd3d.train", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {field}: "), lines[0]
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# resolve_mesh

def test_resolve_mesh_fills_data():
    cfg = config_lib.load(None, ["mesh.data=-1", "mesh.tensor=2"])
    resolved = config_lib.resolve_mesh(cfg, 8)
    assert resolved.mesh.sizes() == {"data": 4, "stage": 1, "tensor": 2, "seq": 1}
    assert cfg.mesh.data == -1  # the input config is frozen and unchanged


def test_resolve_mesh_explicit_ok():
    cfg = config_lib.load(None, ["mesh.data=2", "mesh.tensor=4", "model.num_kv_heads=4"])
    assert config_lib.resolve_mesh(cfg, 8).mesh.sizes()["data"] == 2


@pytest.mark.parametrize("overrides", [
    ["mesh.tensor=3", "model.num_heads=3", "model.num_kv_heads=3", "model.d_model=192",
     "model.vocab_size=258"],
    ["mesh.data=2", "mesh.tensor=2"],
], ids=["tensor-3-does-not-divide-8", "product-4-not-8"])
def test_resolve_mesh_rejects(overrides):
    cfg = config_lib.load(None, overrides)
    with pytest.raises(ConfigError) as e:
        config_lib.resolve_mesh(cfg, 8)
    assert e.value.field == "mesh"
    assert "\n" not in str(e.value)


def test_resolve_mesh_revalidates_with_resolved_data():
    # global_batch 30 passes the static check (data unknown) but not with data = 4.
    cfg = config_lib.load(None, ["train.global_batch=30"])
    with pytest.raises(ConfigError) as e:
        config_lib.resolve_mesh(cfg, 8)
    assert e.value.field == "train.global_batch"
