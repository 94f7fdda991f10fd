"""The command-line contract of every `python -m spmd3d.*` command, without jax.

`--help` must list every config field with its type, default and meaning (from the dataclasses,
so it cannot drift), and every bad argument must end as one `error: argv: ...` line and exit 2.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from spmd3d import cli
from spmd3d import config as config_lib
from spmd3d.cli import Args, Command, Flag
from spmd3d.config import ConfigError
from spmd3d.data import DataError

REPO = Path(__file__).resolve().parent.parent

BENCH = Command("python -m spmd3d.bench", "[CONFIG.yaml] [key=value ...] [--steps=N] [--json]",
                "Times a few training steps of one config.",
                (Flag("--steps", "int", "timed steps", minimum=1),
                 Flag("--warmup", "int", "untimed steps first", minimum=0),
                 Flag("--json", help="also print the record as JSON"),
                 Flag("--profile", "str", "write a trace to this directory")))
INFO = Command("python -m spmd3d.checkpoint", "info RUN_DIR [--verify]",
               "Lists the checkpoints of a run directory.",
               (Flag("--verify", help="read every array back"),), takes_config=False)


def _never(args):
    raise AssertionError(f"body called with {args}")


def _shown(default) -> str:
    """How the help writes a default: as it would be typed after `key=`."""
    if isinstance(default, bool):
        return str(default).lower()
    return '""' if default == "" else str(default)


# ---------------------------------------------------------------------------------------------
def test_field_docs_cover_every_field_in_order():
    docs = config_lib.field_docs()
    expected = [f"{sec.name}.{f.name.rstrip('_')}"
                for sec in dataclasses.fields(config_lib.Config)
                for f in dataclasses.fields(getattr(config_lib.Config(), sec.name))]
    assert [d[0] for d in docs] == expected
    assert docs[0] == ("model.num_layers", "int", 4,
                       "transformer blocks (the stacked [L, ...] layers)")
    assert ("checkpoint.async", "bool", True, "write while training goes on") in docs
    defaults = config_lib.to_dict(config_lib.Config())
    for name, typ, default, meaning in docs:
        sec, key = name.split(".")
        assert defaults[sec][key] == default and type(default).__name__ == typ, name
        assert meaning and "\n" not in meaning, name


def test_help_lists_every_field_with_default_in_aligned_columns():
    text = cli.help_text(BENCH)
    lines = text.splitlines()
    assert lines[0] == "usage: python -m spmd3d.bench [CONFIG.yaml] [key=value ...] [--steps=N] [--json]"
    width = len("--config-dir=VALUE")  # the longest flag: every config command takes it
    assert "  " + "--steps=N".ljust(width) + "  timed steps" in lines
    assert "  " + "--profile=VALUE".ljust(width) + "  write a trace to this directory" in lines
    assert any(line.startswith("  --config-dir=VALUE  look CONFIG up in DIR") for line in lines)
    assert any("key=value overrides any of them" in line for line in lines)
    starts = set()
    for name, typ, default, meaning in config_lib.field_docs():
        [line] = [ln for ln in lines if ln.startswith(f"  {name} ")]
        assert line.split(None, 3) == [name, typ, _shown(default), meaning]
        starts.add(line.index(meaning))
    assert len(starts) == 1  # the meaning column is aligned


def test_help_of_a_positional_command_has_no_config_fields():
    text = cli.help_text(INFO)
    assert text.splitlines()[0] == "usage: python -m spmd3d.checkpoint info RUN_DIR [--verify]"
    assert "  --verify    read every array back" in text.splitlines()
    assert "model.num_layers" not in text and "key=value" not in text


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--nope", "a", "b", "--help"]])
def test_run_help_prints_and_exits_0_before_anything_else(argv, capsys):
    assert cli.run(BENCH, argv, _never) == 0
    out, err = capsys.readouterr()
    assert out == cli.help_text(BENCH) + "\n" and err == ""


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--nope"], "unknown flag --nope (known: --steps=N, --warmup=N, --json, --profile=VALUE, --config-dir=VALUE)"),
    (["--steps=x"], "--steps needs an integer, got 'x'"),
    (["--steps=0"], "--steps must be >= 1, got 0"),
    (["--warmup=-1"], "--warmup must be >= 0, got -1"),
    (["--json=1"], "--json is a switch and takes no value, got '--json=1'"),
    (["--steps"], "--steps needs a value: --steps=N"),
    (["--profile="], "--profile needs a value: --profile=VALUE"),
    (["a.yaml", "stray"], "unexpected argument 'stray' (expected key=value)"),
])
def test_bad_argv_is_one_error_line_and_exit_2(argv, message, capsys):
    assert cli.run(BENCH, argv, _never) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: argv: {message}\n"


def test_positional_command_without_flags_lists_none(capsys):
    bare = dataclasses.replace(INFO, flags=())
    assert cli.run(bare, ["info", "-v"], _never) == 2
    assert capsys.readouterr().err == "error: argv: unknown flag -v (known: none)\n"


@pytest.mark.parametrize("error, line", [
    (ConfigError("model.d_model", "must be positive"), "error: model.d_model: must be positive"),
    (DataError("data.path", "'x' does\nnot exist"), "error: data.path: 'x' does not exist"),
    (type("CheckpointError", (ConfigError,), {})("run.dir", "damaged"), "error: run.dir: damaged"),
])
def test_errors_from_the_body_exit_2_with_one_line(error, line, capsys):
    def body(args):
        raise error

    assert cli.run(BENCH, [], body) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == line + "\n"


def test_body_return_is_the_exit_status():
    assert cli.run(BENCH, [], lambda args: None) == 0
    assert cli.run(BENCH, [], lambda args: 3) == 3


# ---------------------------------------------------------------------------------------------
def test_parse_config_command():
    got = cli.parse(BENCH, ["c.yaml", "train.steps=3", "--steps=5", "mesh.data=-1", "--json",
                            "--profile=out/p"])
    assert got == Args("c.yaml", ["train.steps=3", "mesh.data=-1"],
                       {"--steps": 5, "--json": True, "--profile": "out/p"}, [])
    assert cli.parse(BENCH, []) == Args(None, [], {}, [])


def test_parse_positional_command():
    assert cli.parse(INFO, ["info", "runs/a=b", "--verify"]) == Args(
        None, [], {"--verify": True}, ["info", "runs/a=b"])
    assert cli.parse(INFO, ["info", "x", "y"]).positional == ["info", "x", "y"]


def test_parse_args_lives_in_cli_only():
    assert "parse_args" not in vars(config_lib) and not hasattr(config_lib, "parse_args")

def test_importing_cli_does_not_import_jax():
    code = "import spmd3d.cli, sys; assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
