"""Per-device helpers for code inside a `shard_map` (the pipeline's ticks, the ring's steps,
the loss's pieces): the bottom of the package, importing nothing of it.

- `vary`, `psum`: a value made to vary over manual axes (its cotangent summed over them), and
  a sum over them; `all_gather`, `psum_scatter`: a tiled gather along dim 0 over one manual
  axis (its cotangent reduce-scattered), and a sum scattered along dim 0; every sum of a float
  narrower than 32 bits, forward or backward, runs in fp32;
- `select`, `store_if`: a scalar-predicated choice and buffer write that keep no mask;
- `unrolled_loops` / `unroll`: trace the loops unrolled, for FLOP checks of a schedule.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from functools import partial

import jax
import jax.numpy as jnp

_UNROLL = contextvars.ContextVar("spmd3d_unroll", default=False)


@contextmanager
def unrolled_loops(on: bool = True):
    """Trace the tick, layer and loss scans fully unrolled: XLA's cost analysis counts a loop
    body once, so FLOP checks of a schedule need the loops unrolled (tests only: slow to
    compile)."""
    token = _UNROLL.set(on)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def unroll() -> bool:
    return _UNROLL.get()


def varying(x) -> frozenset:
    """The manual axes a traced value (or its type) varies over."""
    vma = getattr(x, "manual_axis_type", None)
    return frozenset(vma.varying) if vma is not None else frozenset(getattr(x, "vma", ()))


def _narrow(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def psum(x, axes):
    """`lax.psum` over manual `axes`, a float narrower than 32 bits summed in fp32 and cast
    back once: one rounding instead of one per addition (what NeMo's bf16 recipes ask of
    Megatron with `grad_reduce_in_fp32`). It also keeps bf16 all-reduces out of XLA:CPU's
    all-reduce-promotion pass, which aborts the compile on the reducer a shard_map's psum
    lowers to (its root is the sharding constraint's copy: "Invalid binary instruction opcode
    copy")."""
    def one(a):
        return jax.lax.psum(a.astype(jnp.float32), axes).astype(a.dtype) if _narrow(a) else \
            jax.lax.psum(a, axes)

    return jax.tree.map(one, x)


def vary(x, axes):
    """`x` cast to varying over `axes` (those it does not vary over already).

    The transpose of that cast is a sum of the cotangent over those axes (for a weight
    broadcast into a shard_map, its gradient summed over the shards): a narrow float's is
    summed in fp32, as in `psum`. The forward is the plain cast: no fp32 copy of `x`."""
    todo = tuple(a for a in axes if a not in varying(jax.typeof(x)))
    if not todo:
        return x
    return _vary_fp32_sum(x, todo) if _narrow(x) else jax.lax.pcast(x, todo, to="varying")


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _vary_fp32_sum(x, axes):
    return jax.lax.pcast(x, axes, to="varying")


def _vary_fwd(x, axes):
    return _vary_fp32_sum(x, axes), None


def _vary_bwd(axes, _, ct):
    return (psum(ct, axes),)


_vary_fp32_sum.defvjp(_vary_fwd, _vary_bwd)


def all_gather(x, axis):
    """`lax.all_gather(x, axis, tiled=True)` along dim 0; the backward's reduce-scatter of a
    narrow float sums in fp32 (the gather itself moves the narrow dtype: nothing is summed)."""
    return _gather_fp32_sum(x, axis) if _narrow(x) else \
        jax.lax.all_gather(x, axis, tiled=True)


def psum_scatter(x, axis):
    """`lax.psum_scatter(x, axis, tiled=True)` along dim 0, a narrow float summed in fp32
    and cast back; the backward's all-gather moves the narrow dtype."""
    return _scatter_fp32_sum(x, axis) if _narrow(x) else \
        jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_fp32_sum(x, axis):
    return jax.lax.all_gather(x, axis, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scatter_fp32_sum(x, axis):
    return jax.lax.psum_scatter(x.astype(jnp.float32), axis, scatter_dimension=0,
                                tiled=True).astype(x.dtype)


_gather_fp32_sum.defvjp(lambda x, axis: (_gather_fp32_sum(x, axis), None),
                        lambda axis, _, ct: (_scatter_fp32_sum(ct, axis),))
_scatter_fp32_sum.defvjp(lambda x, axis: (_scatter_fp32_sum(x, axis), None),
                         lambda axis, _, ct: (_gather_fp32_sum(ct, axis),))


def select(pred, a, b):
    """`a` where the scalar `pred` holds, else `b`: the predicate stays a scalar (jnp.where
    would broadcast it, and the backward would keep that [mb, T, D] mask per tick)."""
    return jax.tree.map(lambda x, y: jax.lax.select_n(pred, y, x), a, b)


def store_if(pred, buffer, slot, value, axis: int):
    """`buffer` with `value` in `slot` along `axis` where `pred` holds, as it was elsewhere."""
    old = jax.lax.dynamic_index_in_dim(buffer, slot, axis, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, select(pred, value, old), slot, axis)
