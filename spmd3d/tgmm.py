"""The experts' weight gradient as a Pallas-Triton kernel: `dw[g] = x[rows of g]^T @ dy[rows of g]`.

The grouped matmul's backward has two dots (`grouped.py`): the input's gradient, a grouped
matmul like the forward, and the weights', which contracts each group's rows ("tgmm" in
megablox's words): `[M, D] x [M, F] -> [G, D, F]`. On a GPU XLA runs the second at about 50
TFLOP/s with a padded copy of its operands, and tokamax's Hopper kernel for it was measured
wrong (docs/moe.md), so this is ours.

One program per (group, D tile, F tile) walks its group's rows in blocks of `block_k`, loads
the two operands' tiles masked to the group (a row outside reads as 0, so NaN past the groups
or in a neighbour cannot leak in) and accumulates `x^T dy` in fp32; an empty group writes 0.
A block's start is clamped so that it stays inside the arrays (the mask still selects the
group's rows), which is what lets Pallas's interpreter run the same kernel on a CPU: the
tests check it there against `jax.lax.ragged_dot_general`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# the kernel runs through Pallas's interpreter where this is True: the tests run it on a CPU
INTERPRET = False
# (block_d, block_f, block_k, num_warps, num_stages): the default, and the candidates
# `python -m spmd3d.microbench` times on a GPU
BLOCKS = (128, 256, 64, 8, 3)  # the fastest on an H200 at the coarse bench shape (523 TFLOP/s)
# (on an H200 at the coarse shape: 523, 430 and 430 TFLOP/s; 128x128x64 with 4 warps and 4
# stages 399, 256x128x64 410, 64x128x64 377, docs/moe.md)
CANDIDATES = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 4, 4),
              (128, 256, 32, 8, 4))


def weight_gradient(x_md, dy_mf, sizes_g, *, dtype=None, blocks=BLOCKS, interpret=False):
    """`[G, D, F]`: for each group g, `x[rows of g]^T @ dy[rows of g]` (rows sorted by group,
    `sizes_g` rows each; rows past the groups ignored), accumulated in fp32, as `dtype`
    (default x's). `jax.lax.ragged_dot_general` with `_DW`'s dimension numbers is the oracle."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    block_d, block_f, block_k, warps, stages = blocks
    (m, d), f, g = x_md.shape, dy_mf.shape[1], sizes_g.shape[0]
    dtype = jnp.dtype(dtype or x_md.dtype)
    block_d, block_f = min(block_d, _ceil(d, 16)), min(block_f, _ceil(f, 16))
    pad_m, pad_d, pad_f = max(block_k - m, 0), -d % block_d, -f % block_f
    if pad_m or pad_d or pad_f:  # only small shapes pay this: the real ones divide
        x_md = jnp.pad(x_md, ((0, pad_m), (0, pad_d)))
        dy_mf = jnp.pad(dy_mf, ((0, pad_m), (0, pad_f)))
    rows = x_md.shape[0]
    ends = jnp.cumsum(sizes_g.astype(jnp.int32))
    bounds = jnp.stack([ends - sizes_g.astype(jnp.int32), ends])  # [2, G]: start, end

    def kernel(bounds_ref, x_ref, dy_ref, out_ref):
        group, i, j = (pl.program_id(a) for a in range(3))
        start, end = bounds_ref[0, group], bounds_ref[1, group]
        cols_d, cols_f = pl.ds(i * block_d, block_d), pl.ds(j * block_f, block_f)

        def body(step, acc):
            lo = start + step * block_k  # this block's first row of the group
            base = jnp.minimum(lo, rows - block_k)  # clamped inside the arrays
            row = base + jnp.arange(block_k)
            mask = ((row >= lo) & (row < end))[:, None]
            xs = plt.load(x_ref.at[pl.ds(base, block_k), cols_d], mask=mask, other=0.)
            dys = plt.load(dy_ref.at[pl.ds(base, block_k), cols_f], mask=mask, other=0.)
            return acc + plt.dot(xs, dys, trans_a=True)

        steps = (end - start + block_k - 1) // block_k
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_d, block_f), jnp.float32))
        out_ref[...] = acc.astype(out_ref.dtype)

    out = pl.pallas_call(
        kernel,
        grid=(g, x_md.shape[1] // block_d, dy_mf.shape[1] // block_f),
        out_specs=pl.BlockSpec((None, block_d, block_f), lambda gi, i, j: (gi, i, j)),
        out_shape=jax.ShapeDtypeStruct((g, x_md.shape[1], dy_mf.shape[1]), dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="tgmm",
    )(bounds, x_md, dy_mf)
    return out[:, :d, :f]


def _ceil(n: int, k: int) -> int:
    return -(-n // k) * k


def reference(x_md, dy_mf, sizes_g, dtype=None):
    """The oracle: XLA's `ragged_dot_general` contracting each group's rows."""
    dims = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
    return jax.lax.ragged_dot_general(x_md, dy_mf, sizes_g, dims,
                                      preferred_element_type=dtype or x_md.dtype)

