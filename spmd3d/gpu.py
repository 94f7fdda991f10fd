"""The GPU preset: a small, versioned set of XLA/JAX settings chosen from the layout.

XLA's GPU defaults leave communication mostly un-overlapped, and the flags that change that move
between releases. On a GPU the entry points call `apply` right after `simulate_devices`, before
jax starts a backend (XLA reads XLA_FLAGS once, at backend start). Preset `PRESET_VERSION`,
curated for jax/jaxlib 0.10 from NVIDIA JAX-Toolbox's GPU performance guide
(`docs/GPU_performance.md`), with the defaults read from jaxlib 0.10.2's compile options:

* always `XLA_PYTHON_CLIENT_MEM_FRACTION=0.90`: jax's allocator takes 75 % of the GPU by
  default, which refuses layouts that fit (docs/choices.md).
* always `JAX_OPTIMIZATION_LEVEL=O1`: one knob for the latency-hiding scheduler (collectives
  overlap compute), pipelined all-gather / reduce-scatter / all-reduce across loop iterations
  and while-loop double buffering -- what five XLA flags used to turn on.
* ZeRO-3 over `data`: `xla_gpu_all_gather_combine_threshold_bytes` and
  `xla_gpu_reduce_scatter_combine_threshold_bytes` = one layer's weights as a device gathers
  them (its `tensor` shard, in `model.param_dtype`), rounded up to a power of two. XLA's
  default, 30 MiB, cuts a bigger layer into several smaller, slower collectives; the guide asks
  for at least one layer. Not more: with unrolled layers a larger threshold lets XLA merge
  several layers' gathers and hold their weights at once, the memory ZeRO-3 exists to save. A
  layer under 30 MiB leaves both unset (a lower value only combines less, and unset keeps XLA's
  memory-aware heuristic for pipelined collectives).
* a pipeline (`mesh.stage > 1`): `xla_gpu_enable_pipelined_p2p=true` with
  `xla_gpu_collective_permute_decomposer_threshold=1024`: the stage shift's collective-permute
  becomes send/recv pairs that XLA pipelines across the tick loop, so the transfer overlaps the
  next tick's compute. The default threshold (int64 max) decomposes nothing, leaving the p2p
  pipeliner nothing to act on.
* tensor parallelism with sequence parallelism (`mesh.tensor > 1`,
  `parallel.sequence_parallel`): `xla_gpu_threshold_for_windowed_einsum_mib=0`, collective
  matmul: the all-gather before a column-parallel matmul and the reduce-scatter after a
  row-parallel one run in chunks that overlap the matmul (default 100000 MiB: never; the
  multi-streamed variant is on by default). Without SP, tensor parallelism's collectives are
  all-reduces, which windowed einsum does not split.
* FP8 GEMMs (`model.fp8`, not emulated): `xla_gpu_enable_triton_gemm=false`, so that XLA's GEMM
  rewriter hands each FP8 dot to cuBLASLt. With Triton's GEMMs on, XLA fuses the FP8 dots into
  Triton kernels and autotunes each: on one H200 (jax 0.11.2) one layer of the 1B preset did not
  compile in 75 s, and with autotuning off its Triton FP8 kernels ran 16x slower than cuBLASLt's
  (1,214 ms against 75 ms a step, 0 against 12 FP8 GEMMs). The bf16 steps are as fast without
  Triton's GEMMs (1B 255.7 ms against 262.3, 3B 333.1 against 334.8), but stay as they were.

Precedence: preset < the environment's XLA_FLAGS < `run.xla_flags`. A flag this jaxlib does
not know (`xla_gpu_graph_level` is gone from 0.10) aborts the process at backend start, so a
CPU-only subprocess (about a second) tries the flags first and those it refuses are dropped
with a warning. This module imports no jax: `config.py` uses its flag parser.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pkgutil
import re
import subprocess
import sys
from typing import Callable, MutableMapping

from .parsing import parse_xla_flags

PRESET_VERSION = "2026.11-jax0.10"
OPTIMIZATION_LEVEL = "O1"
MEM_FRACTION = "0.90"
XLA_DEFAULT_COMBINE_BYTES = 30 * 2**20 + 7  # XLA's kDefaultAllGatherCombineThreshold (and RS)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")

LOG = logging.getLogger("spmd3d.gpu")


# ------------------------------------------------------------------------------- the flags

def _token(name: str, value: str | None) -> str:
    return f"--{name}" if value is None else f"--{name}={value}"


def _name(token: str) -> str:
    return token.lstrip("-").split("=", 1)[0]


def layer_bytes(model) -> int:
    """Bytes of one transformer layer's weights in `param_dtype`."""
    return model.layer_params * DTYPE_BYTES[model.param_dtype]


def combine_threshold(cfg) -> int | None:
    """ZeRO-3's all-gather/reduce-scatter combine threshold: the power of two at or above one
    layer's weights per device (a `tensor` shard of them); None where XLA's default covers one."""
    per_device = -(-layer_bytes(cfg.model) // cfg.mesh.tensor)
    if per_device <= XLA_DEFAULT_COMBINE_BYTES:
        return None
    return 1 << (per_device - 1).bit_length()


def preset(cfg) -> dict[str, str]:
    """The XLA flags (name -> value) the layout of `cfg` needs on a GPU; see the module doc."""
    mesh, par = cfg.mesh, cfg.parallel
    flags: dict[str, str] = {}
    threshold = combine_threshold(cfg)
    if par.zero_stage == 3 and mesh.data != 1 and threshold:  # data -1: the rest, maybe > 1
        flags["xla_gpu_all_gather_combine_threshold_bytes"] = str(threshold)
        flags["xla_gpu_reduce_scatter_combine_threshold_bytes"] = str(threshold)
    if mesh.stage > 1:
        flags["xla_gpu_enable_pipelined_p2p"] = "true"
        flags["xla_gpu_collective_permute_decomposer_threshold"] = "1024"
    if mesh.tensor > 1 and par.sequence_parallel:
        flags["xla_gpu_threshold_for_windowed_einsum_mib"] = "0"
    if cfg.model.fp8 != "off" and not cfg.model.fp8_emulate:
        flags["xla_gpu_enable_triton_gemm"] = "false"
    return flags


# ---------------------------------------------------------------------- is this run on a GPU

def cuda_plugin_installed() -> bool:
    """Whether jax has a CUDA plugin to load, found without importing it: the
    `jax_cuda1x_plugin` packages or an `xla_cuda*` module in the `jax_plugins` namespace."""
    try:
        if any(importlib.util.find_spec(name) for name in CUDA_PLUGINS):
            return True
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return False
    paths = list(spec.submodule_search_locations or []) if spec else []
    return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(paths))


def on_gpu(cfg, environ=os.environ) -> bool:
    """Whether jax will pick a GPU backend, decided before it starts: not with simulated CPU
    devices, not when JAX_PLATFORMS names neither cuda nor gpu, not without a CUDA plugin."""
    if cfg.mesh.simulated_devices > 0:
        return False
    platforms = {p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",")} - {""}
    if platforms and not platforms & {"cuda", "gpu"}:
        return False
    return cuda_plugin_installed()


# ------------------------------------------------------------ which flags this jaxlib accepts

_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_BAD_VALUE = re.compile(r"Couldn't interpret value .* for flag (\w+)")


def _start_cpu_backend(tokens: list[str], environ) -> subprocess.CompletedProcess | None:
    # XLA parses every flag, the GPU ones included, when any backend starts: CPU will do
    env = {**environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(tokens)}
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None


def rejected_flags(tokens: list[str], environ=os.environ) -> set[str] | None:
    """Names of the flags among `tokens` the installed jaxlib refuses (unknown names, values it
    cannot read), found by starting a CPU backend with them in a subprocess. None: the check
    itself failed (jax would not start for another reason)."""
    out = _start_cpu_backend(tokens, environ)
    if out is None:
        return None
    if out.returncode == 0:
        return set()
    names = set()
    for line in out.stderr.splitlines():
        if m := _UNKNOWN.search(line):
            names.update(_name(t) for t in m.group(1).split())
        elif m := _BAD_VALUE.search(line):
            names.add(m.group(1))
    if names:
        return names
    if "Flag parsing failed" not in out.stderr:
        return None
    # a value it cannot read, without the flag's name (an enum): one flag at a time
    alone = {t: _start_cpu_backend([t], environ) for t in tokens}
    return {_name(t) for t, r in alone.items() if r is not None and r.returncode != 0}


# ---------------------------------------------------------------------------------- applying

def _set_optimization_level(environ: MutableMapping[str, str]) -> str:
    """O1 unless the user chose a level (environment, or jax's config if jax is imported)."""
    jax = sys.modules.get("jax")
    current = getattr(getattr(jax, "config", None), "jax_optimization_level", None)
    theirs = environ.get("JAX_OPTIMIZATION_LEVEL") or (
        str(current) if current not in (None, "", "UNKNOWN") else "")
    if theirs:
        return f"JAX_OPTIMIZATION_LEVEL={theirs} (yours; the preset's is {OPTIMIZATION_LEVEL})"
    environ["JAX_OPTIMIZATION_LEVEL"] = OPTIMIZATION_LEVEL
    if jax is not None and hasattr(jax, "config"):  # read the environment at its import
        jax.config.update("jax_optimization_level", OPTIMIZATION_LEVEL)
    return f"JAX_OPTIMIZATION_LEVEL={OPTIMIZATION_LEVEL}"


def _set_memory_fraction(environ: MutableMapping[str, str]) -> str:
    """jax's allocator takes MEM_FRACTION of the GPU at start (0.75 by default, 60 of an H100's
    80 GB); the preset takes 0.9, leaving the rest to cuDNN's,
    cuBLAS's and NCCL's own buffers. Left alone when the user chose the fraction or the
    allocator."""
    name = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    if environ.get(name):
        return f"{name}={environ[name]} (yours; the preset's is {MEM_FRACTION})"
    if environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") or environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"):
        return "XLA_PYTHON_CLIENT_PREALLOCATE/ALLOCATOR: yours"
    environ[name] = MEM_FRACTION
    return f"{name}={MEM_FRACTION}"


def _version_note() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        running = version("jax")
    except PackageNotFoundError:
        return ""
    curated = PRESET_VERSION.rsplit("-jax", 1)[1]
    same = running.split(".")[:2] == curated.split(".")[:2]
    return "" if same else f" (curated for jax {curated}, this is jax {running})"


def _drop_rejected(tokens: list[str], environ, probe: Callable) -> list[str]:
    """`tokens` less those the jaxlib refuses, each drop a warning; a second probe checks
    what is left (a refused value can hide an unknown name behind it)."""
    for _ in range(2):
        bad = probe(tokens, environ)
        if bad is None:
            LOG.warning("warning: could not check XLA_FLAGS against this jaxlib (a CPU backend "
                        "would not start); using them unchecked")
            return tokens
        dropped = [t for t in tokens if _name(t) in bad]
        if not dropped:
            return tokens
        LOG.warning(f"warning: this jaxlib does not accept {' '.join(dropped)}: dropped from "
                    f"XLA_FLAGS")
        tokens = [t for t in tokens if _name(t) not in bad]
    return tokens


def apply(cfg, environ: MutableMapping[str, str] = os.environ,
          probe: Callable = rejected_flags) -> list[str]:
    """On a GPU: set JAX_OPTIMIZATION_LEVEL and XLA_FLAGS in `environ` (preset < its XLA_FLAGS
    < `run.xla_flags`, less the flags `probe(tokens, environ)` names as refused) and return
    lines saying what was applied. Elsewhere nothing: []. Must run before jax starts a backend."""
    if not on_gpu(cfg, environ):
        return []
    level = _set_optimization_level(environ)
    fraction = _set_memory_fraction(environ)
    wanted = preset(cfg)
    merged: dict[str, str | None] = dict(wanted)
    merged.update(parse_xla_flags(environ.get("XLA_FLAGS", ""), "XLA_FLAGS"))
    merged.update(parse_xla_flags(cfg.run.xla_flags))
    tokens = _drop_rejected([_token(n, v) for n, v in merged.items()], environ, probe)
    environ["XLA_FLAGS"] = " ".join(tokens)
    lines = [f"GPU preset {PRESET_VERSION}{_version_note()}: "
             + ", ".join([level, fraction] + [_token(n, v) for n, v in wanted.items()])]
    if tokens:
        lines.append(f"XLA_FLAGS (preset < environment < run.xla_flags): {' '.join(tokens)}")
    return lines
