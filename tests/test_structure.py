"""The package's shape: its import graph has no cycles and storage sits at the bottom, the command
modules start without jax, every command answers --help, and modules stay small."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd3d import config

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spmd3d"
FILES = {".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
         for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.parent != PACKAGE}
MODULES = sorted(FILES)  # `plan` is the package plan/, `plan.__main__` its command


def imports_of(module: str) -> set[str]:
    """The spmd3d modules `module` imports anywhere in its body (inside functions too: a lazy
    import is still a dependency); relative imports resolved against its package."""
    path = FILES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)]
        elif (node.module or "").startswith("spmd3d."):
            base = []
        else:
            continue
        name = (node.module or "").removeprefix("spmd3d.") if node.level == 0 else node.module
        target = base + (name.split(".") if name else [])
        candidates = [".".join(target + [a.name]) for a in node.names] if not name else []
        found = [c for c in candidates if c in FILES] or [".".join(target)]
        out.update(found)
    return out & set(MODULES) - {module}


GRAPH = {m: imports_of(m) for m in MODULES}


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_graph_is_read():
    assert {"plan", "sharding", "pipeline"} <= GRAPH["step"]
    assert "runtime" in GRAPH["train"] and "cli" in GRAPH["train"]
    assert {"plan", "footprint", "mesh", "cli"} <= GRAPH["plan.__main__"]
    assert {"pipeline", "sharding", "model"} <= GRAPH["plan"]


# the bottom: the config and its schema, the mesh, storage keys, the command line's parser,
# the per-device helpers inside shard_map, readers of compiled programs, plain-numpy tables
BOTTOM = {"schema", "config", "checks", "parsing", "mesh", "store", "cli", "manual", "hlo", "ops",
          "pipeline.table", "units"}
# the top: what `python -m` runs and nothing imports
COMMANDS = {"__main__", "train", "bench", "plan.__main__", "data.__main__", "checkpoint.__main__",
            "convert.__main__", "generate.__main__", "plot.__main__"}


@pytest.mark.parametrize("module", MODULES)
def test_imports_run_downward(module):
    """The bottom imports only the bottom; nothing but a command imports a command."""
    if module in BOTTOM:
        assert GRAPH[module] <= BOTTOM, GRAPH[module] - BOTTOM
    if module not in COMMANDS:
        assert not GRAPH[module] & COMMANDS, GRAPH[module] & COMMANDS


@pytest.mark.parametrize("module", MODULES)
def test_no_import_cycles(module):
    assert module not in reachable(module), f"{module} imports itself through {GRAPH[module]}"


def test_storage_imports_nothing_above_the_config():
    assert reachable("store") == set()
    # gpu: the XLA flag parser config validation uses; stdlib on the schema, nothing above
    assert reachable("gpu") <= {"schema", "parsing"}
    assert reachable("checkpoint") <= {"store", "config", "checks", "parsing", "schema"}
    # the Hugging Face mapping is numpy on the checkpoint schema and its files: nothing that
    # computes
    assert reachable("hf") <= {"schema", "hf_files", "hf_config"}
    assert reachable("hf_files") <= {"schema"}


def test_the_model_does_not_run_the_pipeline():
    """The model is math: it reaches neither the plan, the step nor any schedule (the
    per-device helpers it shares with them live in `manual`)."""
    below = reachable("model")
    assert not {"step", "plan", "runtime"} & below
    assert not [m for m in below if m.split(".")[0] == "pipeline"], below


def test_the_step_names_no_feature_of_the_model():
    """The train step advances the state the optimizer does not train through that state's own
    type (`untrained.advance_untrained`: the router's bias, FP8's histories): it imports
    neither the MoE layer nor FP8."""
    assert not {"moe", "fp8"} & GRAPH["step"], GRAPH["step"]


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_command_modules_import_without_jax():
    code = ("import sys\nimport spmd3d.train, spmd3d.bench, spmd3d.cli, spmd3d.config, spmd3d.convert\n"
            "import spmd3d.convert.__main__, spmd3d.generate.__main__, spmd3d.plot.__main__\n"
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]\n")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("command", ["train", "bench", "checkpoint", "plan", "convert", "generate",
                                     "plot"])
def test_every_command_answers_help(command):
    out = subprocess.run([sys.executable, "-m", f"spmd3d.{command}", "--help"], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: python -m spmd3d.{command} ")
    if command == "checkpoint":
        assert "info RUN_DIR" in out.stdout and "--verify" in out.stdout
        return
    if command == "convert":
        assert "import HF_DIR RUN_DIR" in out.stdout and "export RUN_DIR HF_DIR" in out.stdout
        return
    if command in ("generate", "plot"):  # their flags only: they take no config file
        assert ("--prompt" if command == "generate" else "--out") in out.stdout
        return
    lines = out.stdout.splitlines()
    for name, typ, default, meaning in config.field_docs():
        row = [line for line in lines if line.split()[:1] == [name]]
        assert len(row) == 1, name
        assert typ in row[0].split() and meaning in row[0], row[0]


# modules over STYLE.md's ~400 lines, each with the split that brings it under: the list
# only shrinks
OVER_400: dict[str, str] = {}


def test_the_pipeline_runtime_reads_in_short_functions():
    """The pipeline's runtime is its table's shape (a placement, the buffers' bookkeeping as
    their methods, one executor per operation kind): no function of `pipeline/` runs past 80
    lines (its nested functions counted within it)."""
    import ast

    long = {}
    for m in MODULES:
        if m == "pipeline" or m.startswith("pipeline."):
            for node in ast.walk(ast.parse(FILES[m].read_text())):
                if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 80:
                    long[f"{m}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_modules_stay_small():
    sizes = {m: len(FILES[m].read_text().splitlines()) for m in MODULES}
    over = {m for m, n in sizes.items() if n > 400}
    assert over <= set(OVER_400), {m: sizes[m] for m in over - set(OVER_400)}
    assert all(sizes[m] > 400 for m in OVER_400), "under 400 now: take it off OVER_400"
    assert max(sizes.values()) <= 450, sizes
