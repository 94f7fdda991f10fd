"""The GPU preset (`spmd3d/gpu.py`): when it applies, what the layout gets, who overrides whom,
and the jaxlib check that drops unknown flags. Nothing here compiles a model: the presets are
pure functions of the config, and the only subprocesses start a bare CPU backend (~1 s each).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest

from spmd3d import bench as bench_lib
from spmd3d import config as config_lib
from spmd3d import gpu
from spmd3d import train as train_lib
from spmd3d.config import ConfigError

AG = "xla_gpu_all_gather_combine_threshold_bytes"
RS = "xla_gpu_reduce_scatter_combine_threshold_bytes"
P2P = "xla_gpu_enable_pipelined_p2p"
DECOMPOSE = "xla_gpu_collective_permute_decomposer_threshold"
WINDOWED = "xla_gpu_threshold_for_windowed_einsum_mib"
TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def llama8b(**sections):
    cfg = config_lib.load("llama3_8b")
    return config_lib.override(cfg, **sections) if sections else cfg


@pytest.fixture
def cuda(monkeypatch):
    """A machine with a CUDA plugin, and no jax imported (`apply` would update its config)."""
    monkeypatch.setattr(gpu, "cuda_plugin_installed", lambda: True)
    monkeypatch.delitem(sys.modules, "jax", raising=False)


@pytest.fixture
def gpu_log(caplog):
    """The `spmd3d.gpu` records, even where the `spmd3d` logger stops their propagation."""
    logger = logging.getLogger("spmd3d.gpu")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def no_probe(tokens, environ):
    raise AssertionError("probed on a CPU run")


# ------------------------------------------------------------------------------ on a GPU?

def test_on_gpu_needs_a_cuda_plugin_and_no_cpu_pin(cuda):
    cfg = config_lib.load()  # simulated_devices -1: a GPU when one is there
    assert gpu.on_gpu(cfg, {})
    assert gpu.on_gpu(cfg, {"JAX_PLATFORMS": "cuda,cpu"})
    assert not gpu.on_gpu(cfg, {"JAX_PLATFORMS": "cpu"})
    assert not gpu.on_gpu(config_lib.override(cfg, mesh={"simulated_devices": 4}), {})


def test_no_cuda_plugin_means_no_gpu(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_plugin_installed", lambda: False)
    assert not gpu.on_gpu(config_lib.load(), {})


@pytest.mark.parametrize("layout", ["jax_plugins/xla_cuda12/__init__.py",
                                    "jax_cuda13_plugin/__init__.py"])
def test_cuda_plugin_found_without_importing_it(layout, tmp_path, monkeypatch):
    (tmp_path / layout).parent.mkdir(parents=True)
    (tmp_path / layout).write_text("raise ImportError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gpu.cuda_plugin_installed()


# ----------------------------------------------------------------------- what a layout gets

def test_zero3_combines_at_least_one_layer():
    cfg = llama8b()  # ZeRO-3 over data 8, float32 master weights
    one_layer = 4 * (4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336)
    assert gpu.layer_bytes(cfg.model) == one_layer == 872_415_232
    flags = gpu.preset(cfg)
    assert set(flags) == {AG, RS}
    threshold = int(flags[AG])
    assert int(flags[RS]) == threshold == 2**30  # the power of two above 832 MiB
    assert one_layer <= threshold < 2 * one_layer


def test_zero3_threshold_is_per_device_and_only_above_xla_default():
    # a tensor shard of a layer is what a device gathers: 832 MiB / 8 -> 128 MiB
    assert gpu.preset(llama8b(mesh={"tensor": 8, "data": 1}, parallel={"zero_stage": 3})) == {}
    assert gpu.preset(llama8b(mesh={"tensor": 8, "data": -1}))[AG] == str(2**27)
    # one data shard: nothing to gather; ZeRO-1 gathers nothing per layer
    assert gpu.preset(llama8b(mesh={"data": 1})) == {}
    assert gpu.preset(llama8b(parallel={"zero_stage": 1})) == {}
    # the demo's layers are far under XLA's 30 MiB default: left to XLA
    assert gpu.preset(config_lib.load(None, ["parallel.zero_stage=3"])) == {}


def test_pipelined_p2p_only_with_a_pipeline():
    flags = gpu.preset(llama8b(mesh={"stage": 2}))
    assert flags[P2P] == "true" and flags[DECOMPOSE] == "1024"
    for cfg in (llama8b(), config_lib.load()):
        assert P2P not in gpu.preset(cfg) and DECOMPOSE not in gpu.preset(cfg)


def test_windowed_einsum_only_with_tensor_and_sequence_parallelism():
    on = llama8b(mesh={"tensor": 2}, parallel={"sequence_parallel": True})
    assert gpu.preset(on)[WINDOWED] == "0"
    assert WINDOWED not in gpu.preset(llama8b(mesh={"tensor": 2}))
    assert WINDOWED not in gpu.preset(llama8b(parallel={"sequence_parallel": True}))


def test_fp8_gemms_go_to_cublaslt_not_triton():
    """Triton's FP8 GEMMs took XLA's compile past 75 s a layer on an H200 (gpu.py)."""
    assert gpu.preset(llama8b(model={"fp8": "delayed"}))[TRITON_GEMM] == "false"
    assert TRITON_GEMM not in gpu.preset(llama8b())
    assert TRITON_GEMM not in gpu.preset(llama8b(model={"fp8": "delayed", "fp8_emulate": True}))


# ---------------------------------------------------------------------------------- apply

def test_apply_is_a_no_op_on_cpu():
    environ = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    before = dict(environ)
    assert gpu.apply(llama8b(run={"xla_flags": "--xla_gpu_enable_command_buffer="}), environ,
                     probe=no_probe) == []
    assert environ == before


def test_precedence_preset_then_environment_then_run_xla_flags(cuda):
    user = f"--{P2P}=true --xla_gpu_enable_command_buffer="
    cfg = llama8b(mesh={"stage": 2}, run={"xla_flags": user})
    environ = {"XLA_FLAGS": f"--{AG}=5 --{P2P}=false --xla_force_host_platform_device_count=8"}
    probed = []
    lines = gpu.apply(cfg, environ, probe=lambda tokens, env: probed.append(tokens) or set())
    got = gpu.parse_xla_flags(environ["XLA_FLAGS"], "XLA_FLAGS")
    assert got[AG] == "5"  # the environment over the preset
    assert got[RS] == str(2**30) and got[DECOMPOSE] == "1024"  # the preset where no one spoke
    assert got[P2P] == "true"  # run.xla_flags over the environment
    assert got["xla_gpu_enable_command_buffer"] == ""  # "--name=" keeps its empty value
    assert got["xla_force_host_platform_device_count"] == "8"
    assert probed == [environ["XLA_FLAGS"].split()]
    assert environ["JAX_OPTIMIZATION_LEVEL"] == "O1"
    assert lines[0].startswith(f"GPU preset {gpu.PRESET_VERSION}") and "O1" in lines[0]
    assert f"--{RS}={2**30}" in lines[0] and environ["XLA_FLAGS"] in lines[1]


def test_a_chosen_optimization_level_is_kept(cuda):
    environ = {"JAX_OPTIMIZATION_LEVEL": "O0"}
    lines = gpu.apply(config_lib.load(), environ, probe=lambda tokens, env: set())
    assert environ["JAX_OPTIMIZATION_LEVEL"] == "O0" and "O0 (yours" in lines[0]


@pytest.mark.parametrize("theirs,want", [
    ({}, "0.90"), ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, "0.5"),
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, None)])
def test_the_allocator_takes_most_of_the_gpu_unless_chosen(cuda, theirs, want):
    """jax's default, 75 %, leaves 20 of an H100's 80 GB unused; the user's choice is kept."""
    environ = dict(theirs)
    lines = gpu.apply(config_lib.load(), environ, probe=lambda tokens, env: set())
    assert environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") == want
    assert ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.90" in lines[0]) == (not theirs), lines[0]


def test_an_imported_jax_gets_the_level_in_its_config(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_plugin_installed", lambda: True)
    updates = []
    config = types.SimpleNamespace(jax_optimization_level="UNKNOWN",
                                   update=lambda name, value: updates.append((name, value)))
    monkeypatch.setitem(sys.modules, "jax", types.SimpleNamespace(config=config))
    gpu.apply(config_lib.load(), {}, probe=lambda tokens, env: set())
    assert updates == [("jax_optimization_level", "O1")]


def test_the_probe_drops_an_unknown_flag_and_keeps_a_known_one(cuda, gpu_log):
    known = "--xla_gpu_enable_latency_hiding_scheduler=true"
    cfg = config_lib.load(None, [f"run.xla_flags={known} --xla_spmd3d_made_up=1"])
    environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    gpu.apply(cfg, environ)  # the real probe: a subprocess starts a CPU backend
    assert environ["XLA_FLAGS"] == known
    [warning] = {r.getMessage() for r in gpu_log.records  # one, whichever handlers saw it
                 if r.name == "spmd3d.gpu" and r.levelno == logging.WARNING}
    assert "--xla_spmd3d_made_up=1" in warning and "latency_hiding" not in warning


def test_the_probe_names_flags_whose_values_it_cannot_read():
    known = "--xla_gpu_enable_latency_hiding_scheduler=true"
    assert gpu.rejected_flags([known, f"--{P2P}=maybe"]) == {P2P}
    # an enum value it cannot read names no flag: each is then tried alone
    enum = "--xla_gpu_experimental_pipeline_parallelism_opt_level=BOGUS"
    assert gpu.rejected_flags([known, enum]) == {
        "xla_gpu_experimental_pipeline_parallelism_opt_level"}


def test_every_preset_flag_is_known_to_this_jaxlib():
    cfg = llama8b(mesh={"stage": 2, "tensor": 2}, parallel={"sequence_parallel": True})
    flags = gpu.preset(cfg)
    assert {AG, RS, P2P, DECOMPOSE, WINDOWED} == set(flags)
    assert gpu.rejected_flags([f"--{n}={v}" for n, v in flags.items()]) == set()


# ------------------------------------------------------------------------- run.xla_flags

def test_parse_xla_flags():
    assert gpu.parse_xla_flags(" --a=1  --b --c= --a=2 ") == {"a": "2", "b": None, "c": ""}
    assert gpu.parse_xla_flags("") == {}
    for bad in ("bogus", "-a=1", "--=1", "--a-b=1"):
        with pytest.raises(ConfigError) as e:
            gpu.parse_xla_flags(bad)
        assert e.value.field == "run.xla_flags" and repr(bad) in str(e.value)


@pytest.mark.parametrize("main", [train_lib.main, bench_lib.main], ids=["train", "bench"])
def test_bad_xla_flags_exit_2_naming_the_field(main, tmp_path, capsys):
    rc = main(["run.xla_flags=bogus", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: run.xla_flags: 'bogus' is not --name=value"), err
    assert not (tmp_path / "run").exists()


def test_bad_xla_flags_exit_2_from_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "spmd3d.train", "run.xla_flags=--ok=1 oops"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: run.xla_flags: 'oops'"), line
