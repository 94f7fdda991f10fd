"""The experts' grouped matmul and which implementation runs it, chosen once in the plan.

`y[M, F] = x[M, D] @ w[g(m), D, F]` for rows sorted by group, `sizes[G]` rows per group, rows past
the groups giving zero (`jax.lax.ragged_dot`'s contract). The kernels (`Plan.experts`, stated in a
run's first lines):

* `ragged`: `jax.lax.ragged_dot`. On a CPU (exact; XLA:CPU computes each group as a dense
  matmul over all the rows, masked), or when asked.
* `tokamax`: `tokamax.ragged_dot`, Pallas Mosaic GPU kernels on Hopper, Triton ones before it,
  for the forward and the input's gradient; XLA's for the weights' (`_tokamax` says why). On a
  GPU when tokamax is installed (`pip install spmd3d[gpu]`).
* `capacity`: no grouped matmul; fixed [capacity, D] buffers per expert and batched matmuls
  (`moe.capacity_ffn`). Whenever `model.capacity_factor` > 0.

On a GPU, jax 0.10 lowers `ragged_dot` to a zero-padded dense matmul (XLA's own notes say so;
about 2 % of a grouped GEMM's speed was measured on a B200), hence tokamax there, and a one-line
warning where the plan has to fall back to `ragged`.

`plan --compile` compiles a GPU plan on CPU devices, which cannot lower tokamax's kernels. There a
stand-in takes their place (`standing_in`): every row times one group's weights, which has the
kernel's buffers and FLOPs (forward [M, F]; backward dx [M, D] and dw [G, D, F]) but not its
arithmetic, as cuDNN attention compiles as the blocked kernel there. It cannot be chosen to train.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util

import jax
import jax.numpy as jnp

from .schema import ConfigError
_STANDIN = contextvars.ContextVar("grouped_standin", default=False)

SLOW = ("tokamax is not installed, so the experts run jax's ragged_dot, which XLA lowers on a "
        "GPU to a zero-padded dense matmul (slow, and its memory grows with the expert count): "
        "pip install tokamax, or set model.capacity_factor")


def _tokamax_installed() -> bool:
    return _STANDIN.get() or importlib.util.find_spec("tokamax") is not None


def choose(requested: str, *, platform: str, capacity_factor: float,
           devices: bool = True) -> tuple[str, str]:
    """(kernel, a warning or "") for `model.expert_kernel = requested` on `platform`; `devices`
    False: a plan without devices, which assumes a GPU has tokamax. An explicit `tokamax` that
    is not installed raises ConfigError naming the field."""
    if capacity_factor > 0:
        return "capacity", ""
    if requested == "tokamax" and not (_tokamax_installed() or not devices):
        raise ConfigError("model.expert_kernel", "tokamax is not installed (pip install tokamax, "
                                                 "or spmd3d[gpu]); use auto or ragged")
    if requested != "auto":
        return requested, ""
    if platform != "gpu":
        return "ragged", ""
    if _tokamax_installed() or not devices:
        return "tokamax", ""
    return "ragged", SLOW


@contextlib.contextmanager
def standing_in():
    """Trace a tokamax plan's step on a CPU with the stand-in (see the module's docstring)."""
    token = _STANDIN.set(True)
    try:
        yield
    finally:
        _STANDIN.reset(token)


def matmul(kernel: str):
    """The grouped matmul `(x[M, D], w[G, D, F], sizes[G]) -> [M, F]` of `kernel`."""
    if kernel == "ragged":
        return jax.lax.ragged_dot
    if kernel != "tokamax":
        raise ValueError(f"no grouped matmul for kernel {kernel!r}")
    return _shaped if _STANDIN.get() else _tokamax


# the backward's dots: [M, F] x [G, D, F] -> [M, D] over the groups of the rows (the input's
# gradient); [M, D] x [M, F] -> [G, D, F] contracting each group's rows (the weights')
_DX = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
_DW = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


def _in_groups(v_m, sizes_g):
    """`v` with the rows past the groups zero (ragged_dot's contract)."""
    return jnp.where(jnp.arange(v_m.shape[0])[:, None] < jnp.sum(sizes_g), v_m, 0)


@jax.custom_vjp
def _tokamax(x_md, w_gdf, sizes_g):
    """tokamax's kernels held to ragged_dot's contract, as measured on an H200 (jax 0.11.2,
    tokamax 0.0.17; docs/moe.md):

    * its rows past the groups are undefined, forward and in the input's gradient (up to 211
      where ragged_dot gives 0, NaN in the gradient): zeroed here. Under expert parallelism
      they are the other devices' assignments, and a NaN would survive their zero weight;
    * its Hopper kernel for the weights' gradient (a dot contracting each group's rows) was
      10-18 % off an fp32 reference in every group: that one is XLA's (0.35 %, bf16), at about
      50 TFLOP/s against tokamax's 320 for the other two."""
    import tokamax

    return _in_groups(tokamax.ragged_dot(x_md, w_gdf, sizes_g), sizes_g)


def _tokamax_fwd(x_md, w_gdf, sizes_g):
    return _tokamax(x_md, w_gdf, sizes_g), (x_md, w_gdf, sizes_g)


def _tokamax_bwd(residuals, g_mf):
    import tokamax

    x_md, w_gdf, sizes_g = residuals
    dx = _in_groups(tokamax.ragged_dot_general(g_mf, w_gdf, sizes_g, _DX), sizes_g)
    dw = jax.lax.ragged_dot_general(x_md, g_mf, sizes_g, _DW, preferred_element_type=w_gdf.dtype)
    return dx.astype(x_md.dtype), dw, None


_tokamax.defvjp(_tokamax_fwd, _tokamax_bwd)


def _dot(a, b, dtype):
    """a @ b as `dtype`, computed as integers of its width: XLA:CPU computes a 2-byte float
    dot in fp32 and holds fp32 copies of its operands and result, which a GPU kernel does not;
    an integer dot it computes as it is. The stand-in needs the shapes, not the values."""
    ints = {2: jnp.int16, 4: jnp.int32}[jnp.dtype(dtype).itemsize]
    a, b = (jax.lax.bitcast_convert_type(v.astype(dtype), ints) for v in (a, b))
    return jax.lax.bitcast_convert_type(jnp.dot(a, b, preferred_element_type=ints), dtype)


@jax.custom_vjp
def _shaped(x_md, w_gdf, sizes_g):
    """The stand-in: a grouped matmul's shapes and FLOPs, not its arithmetic (compile only)."""
    del sizes_g
    return _dot(x_md, w_gdf[0], x_md.dtype)


def _shaped_fwd(x_md, w_gdf, sizes_g):
    return _shaped(x_md, w_gdf, sizes_g), (x_md, w_gdf)


def _shaped_bwd(residuals, g_mf):
    x_md, w_gdf = residuals
    dw = jnp.zeros_like(w_gdf).at[0].set(_dot(x_md.T, g_mf, w_gdf.dtype))
    return _dot(g_mf, w_gdf[0].T, x_md.dtype), dw, None


_shaped.defvjp(_shaped_fwd, _shaped_bwd)
