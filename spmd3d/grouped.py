"""The experts' grouped matmul and which implementation runs it, chosen once in the plan.

`y[M, F] = x[M, D] @ w[g(m), D, F]` for rows sorted by group, `sizes[G]` rows per group, rows past
the groups giving zero (`jax.lax.ragged_dot`'s contract). Its backward is two more dots: the
input's gradient (a grouped matmul again) and the weights' (each group's rows contracted). The
kernels (`Plan.experts`, stated in a run's first lines with the weights' gradient):

* `ragged`: `jax.lax.ragged_dot`. On a CPU (exact; XLA:CPU computes each group as a dense
  matmul over all the rows, masked), or when asked.
* `mosaic`: jax's own Pallas Mosaic GPU kernel (`ragged_dot_mgpu`, Hopper's wgmma) for the
  forward and the input's gradient: on a Hopper GPU in a 2-byte dtype (nothing to install).
* `tokamax`: `tokamax.ragged_dot` (Triton kernels before Hopper) for the forward and the
  input's gradient: on other GPUs when tokamax is installed (`pip install spmd3d[gpu]`).
* `capacity`: fixed [capacity, D] buffers per expert (`moe.capacity_ffn`), the rows in equal
  groups, so batched matmuls (the `batched` kernel here, sizes unused). Whenever
  `model.capacity_factor` > 0.

The weights' gradient (`model.expert_weight_grad`) is ours on a GPU (`tgmm.py`, Pallas-Triton),
XLA's elsewhere; tokamax's own was measured wrong and is never asked (`_weight_grad`). On an
H200 (docs/moe.md) the forward and input gradient ran at 443 TFLOP/s (mosaic), 324 (tokamax)
and 97 (XLA), the weights' gradient at 523 (ours) and 81 (XLA): XLA lowers `ragged_dot` on a
GPU to a zero-padded dense matmul, whose padded copy also costs memory.

All of them run behind one `custom_vjp` (`_grouped`), whose backward keeps the weights as
given, so that no copy of the experts' weights waits for it (what autodiff keeps of a value the
layer made, no remat policy sees): weights with a pair axis, `w[G, D, C, F]` (the experts' gate
and up halves), give `y[M, C, F]`, one matmul per pair, where slicing each half outside made
one copy per stashed pipeline pass (806 MB a layer at 128 experts of 2048 x 768); and
`prepare` (in the MoE layer's shard_map: cast to varying over the tokens' axes) runs inside,
again in the backward, where a prepared value kept was handed out by the shard_map and stacked
by the scan of layers, a copy of all the layers' expert weights.

`plan --compile` compiles a GPU plan on CPU devices, which cannot lower the GPU kernels. There a
stand-in takes their place (`standing_in`): every row times one group's weights, which has the
kernel's buffers and FLOPs (forward [M, F]; backward dx [M, D] and dw [G, D, F]) but not its
arithmetic, as cuDNN attention compiles as the blocked kernel there. It cannot be chosen to train.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
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


def choose(requested: str, *, platform: str, capacity_factor: float, devices: bool = True,
           capability: float = 0.0, dtype: str = "bfloat16") -> tuple[str, str]:
    """(kernel, a warning or "") for `model.expert_kernel = requested` on `platform` (a GPU's
    compute `capability`), computing in `dtype`; `devices` False: a plan without devices,
    which assumes a GPU has tokamax. An explicit kernel that cannot run here raises
    ConfigError naming the field."""
    if capacity_factor > 0:
        return "capacity", ""
    mosaic = _mosaic_runs(platform, capability, dtype)
    if requested == "tokamax" and not (_tokamax_installed() or not devices):
        raise ConfigError("model.expert_kernel", "tokamax is not installed (pip install tokamax, "
                                                 "or spmd3d[gpu]); use auto or ragged")
    if requested == "mosaic" and not (mosaic or _STANDIN.get()):
        raise ConfigError("model.expert_kernel", f"mosaic needs a Hopper GPU (compute capability "
                          f"9.x) and a 2-byte model.dtype (here {platform}, {capability:g}, "
                          f"{dtype}); use auto")
    if requested != "auto":
        return requested, ""
    if platform != "gpu":
        return "ragged", ""
    if mosaic:
        return "mosaic", ""
    if _tokamax_installed() or not devices:
        return "tokamax", ""
    return "ragged", SLOW


def _mosaic_runs(platform: str, capability: float, dtype: str) -> bool:
    """jax's Mosaic GPU grouped matmul is Hopper's (wgmma), with both operands in one 2-byte
    dtype."""
    return platform == "gpu" and 9.0 <= capability < 10.0 and dtype in ("bfloat16", "float16")


@contextlib.contextmanager
def standing_in():
    """Trace a GPU plan's step on a CPU with the stand-in (see the module's docstring)."""
    token = _STANDIN.set(True)
    try:
        yield
    finally:
        _STANDIN.reset(token)


def choose_weight_grad(requested: str, *, platform: str) -> str:
    """The weights' gradient for `model.expert_weight_grad = requested`: auto is our Pallas
    kernel (`tgmm.py`) on a GPU, XLA's `ragged_dot_general` elsewhere."""
    if requested != "auto":
        return requested
    return "pallas" if platform == "gpu" else "xla"


def matmul(kernel: str, weight_grad: str = "xla", prepare=None):
    """The grouped matmul `(x[M, D], w[G, D, F], sizes[G]) -> [M, F]` of `kernel`, its weights'
    gradient by `weight_grad` (`xla` or `pallas`). `prepare` (hashable) makes the weights as
    the matmul uses them (in a shard_map: cast to varying over the tokens' axes), in the
    forward and again in the backward, so that the backward keeps `w` as given: a prepared
    copy kept would be a new value, which a shard_map in a scan of layers stacks."""
    if kernel not in ("ragged", "tokamax", "mosaic", "batched"):
        raise ValueError(f"no grouped matmul for kernel {kernel!r}")
    if weight_grad not in ("xla", "pallas"):
        raise ValueError(f"no weight gradient {weight_grad!r}")
    if _STANDIN.get() and kernel != "batched" and (kernel != "ragged" or weight_grad == "pallas"):
        kernel = None  # the stand-in
    return functools.partial(_grouped, kernel, weight_grad, prepare or _as_given)


# the backward's dots: [M, F] x [G, D, F] -> [M, D] over the groups of the rows (the input's
# gradient); [M, D] x [M, F] -> [G, D, F] contracting each group's rows (the weights')
_DX = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
_DW = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


def _in_groups(v_m, sizes_g):
    """`v` with the rows past the groups zero (ragged_dot's contract)."""
    return jnp.where(jnp.arange(v_m.shape[0])[:, None] < jnp.sum(sizes_g), v_m, 0)


def _as_given(w):
    return w


def _forward(kernel, x_md, w_gdf, sizes_g):
    """`kernel`'s grouped matmul, held to ragged_dot's contract. tokamax's kernels, as
    measured on an H200 (jax 0.11.2, tokamax 0.0.17; docs/moe.md): its rows past the groups
    are undefined, forward and in the input's gradient (up to 211 where ragged_dot gives 0,
    NaN in the gradient), so they are zeroed here: under expert parallelism they are the
    other devices' assignments, and a NaN would survive their zero weight."""
    if kernel is None:
        return _dot(x_md, w_gdf[0], x_md.dtype)
    if kernel == "batched":
        return _batched("gcd,gdf->gcf", x_md, w_gdf)
    if kernel == "ragged":
        return jax.lax.ragged_dot(x_md, w_gdf, sizes_g)
    if kernel == "mosaic":
        return _mosaic(x_md, w_gdf, sizes_g, transpose=False)
    import tokamax

    return _in_groups(tokamax.ragged_dot(x_md, w_gdf, sizes_g), sizes_g)


def _input_grad(kernel, g_mf, w_gdf, sizes_g):
    if kernel is None:
        return _dot(g_mf, w_gdf[0].T, g_mf.dtype)
    if kernel == "batched":
        return _batched("gcf,gdf->gcd", g_mf, w_gdf)
    if kernel == "ragged":
        return jax.lax.ragged_dot_general(g_mf, w_gdf, sizes_g, _DX)
    if kernel == "mosaic":
        return _mosaic(g_mf, w_gdf, sizes_g, transpose=True)
    import tokamax

    return _in_groups(tokamax.ragged_dot_general(g_mf, w_gdf, sizes_g, _DX), sizes_g)


# jax's Pallas Mosaic GPU grouped matmul (Hopper's wgmma), at the blocks measured on an H200
MOSAIC_BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                     grid_block_n=1)


def _batched(spec, a_mk, w_g):
    """The `batched` kernel: the rows in G equal groups ([G, M / G] buffers) by einsum."""
    g = w_g.shape[0]
    return jnp.einsum(spec, a_mk.reshape(g, -1, a_mk.shape[-1]), w_g).reshape(a_mk.shape[0], -1)


def _mosaic(a_mk, w_g, sizes_g, transpose):
    """jax's `ragged_dot_mgpu.ragged_dot`: `a @ w[g]`, or `a @ w[g]^T` (`transpose`, the input's
    gradient); its rows past the groups zeroed, as tokamax's."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    y = ragged_dot_mgpu.ragged_dot(a_mk, w_g, group_sizes=sizes_g, transpose_rhs=transpose,
                                   **MOSAIC_BLOCKS)
    return _in_groups(y, sizes_g)


def _weight_grad(kernel, weight_grad, x_md, g_mf, sizes_g, w_gdf):
    """tokamax's Hopper kernel for this dot (`ragged_contracting_dim_dot_sm90`) was 10-18 %
    off an fp32 reference in every group, so it is never asked: XLA's (0.35 %, bf16, about
    50 TFLOP/s) or ours (`tgmm.py`)."""
    dtype = w_gdf.dtype
    if kernel is None:
        return jnp.zeros_like(w_gdf).at[0].set(_dot(x_md.T, g_mf, dtype))
    if kernel == "batched":
        g = w_gdf.shape[0]
        return jnp.einsum("gcd,gcf->gdf", x_md.reshape(g, -1, x_md.shape[-1]),
                          g_mf.reshape(g, -1, g_mf.shape[-1]), preferred_element_type=dtype)
    if weight_grad == "xla":
        return jax.lax.ragged_dot_general(x_md, g_mf, sizes_g, _DW,
                                          preferred_element_type=dtype)
    from . import tgmm

    return tgmm.weight_gradient(x_md, g_mf, sizes_g, dtype=dtype, interpret=tgmm.INTERPRET)


def _pairs(w, v=None, axis=2):
    """w[G, D, F] as one pair, w[G, D, C, F] as C: the [G, D, F] weights of each (`v` None),
    or the slices of `v` at `axis` that go with them (an output's cotangent, [M, C, F]: 1)."""
    v = w if v is None else v
    if w.ndim == 3:
        return [v]
    return [jax.lax.index_in_dim(v, c, axis, keepdims=False) for c in range(w.shape[2])]


def _per_pair(w, ys, axis):
    """The pairs' results (outputs at `axis` 1, weight gradients at 2) in w's shape: the
    inverse of `_pairs`."""
    return ys[0] if w.ndim == 3 else jnp.stack(ys, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped(kernel, weight_grad, prepare, x_md, w_gdf, sizes_g):
    """kernel None: the stand-in, a grouped matmul's shapes and FLOPs, not its arithmetic
    (compile only): every row times one group's weights."""
    w_gdf = prepare(w_gdf)
    return _per_pair(w_gdf, [_forward(kernel, x_md, w, sizes_g) for w in _pairs(w_gdf)], 1)


def _grouped_fwd(kernel, weight_grad, prepare, x_md, w_gdf, sizes_g):
    return _grouped(kernel, weight_grad, prepare, x_md, w_gdf, sizes_g), (x_md, w_gdf, sizes_g)


def _grouped_bwd(kernel, weight_grad, prepare, residuals, g_mf):
    x_md, w_given, sizes_g = residuals
    w_gdf, prepared = jax.vjp(prepare, w_given)
    pairs = list(zip(_pairs(w_gdf, g_mf, 1), _pairs(w_gdf)))  # (cotangent, weights) each
    dx = sum(_input_grad(kernel, g, w, sizes_g) for g, w in pairs)
    dw = [_weight_grad(kernel, weight_grad, x_md, g, sizes_g, w) for g, w in pairs]
    return dx.astype(x_md.dtype), prepared(_per_pair(w_gdf, dw, 2))[0], None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _dot(a, b, dtype):
    """a @ b as `dtype`, computed as integers of its width: XLA:CPU computes a 2-byte float
    dot in fp32 and holds fp32 copies of its operands and result, which a GPU kernel does not;
    an integer dot it computes as it is. The stand-in needs the shapes, not the values."""
    ints = {2: jnp.int16, 4: jnp.int32}[jnp.dtype(dtype).itemsize]
    a, b = (jax.lax.bitcast_convert_type(v.astype(dtype), ints) for v in (a, b))
    return jax.lax.bitcast_convert_type(jnp.dot(a, b, preferred_element_type=ints), dtype)
