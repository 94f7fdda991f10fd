"""Per-device helpers for code inside a `shard_map` (the pipeline's ticks, the ring's steps,
the loss's pieces): the bottom of the package, importing nothing of it.

- `vary`, `psum`: a value made to vary over manual axes (its cotangent summed over them), and
  a sum over them; `all_gather`, `psum_scatter`: a tiled gather along dim 0 over one manual
  axis (its cotangent reduce-scattered), and a sum scattered along dim 0; every sum of a float
  narrower than 32 bits, forward or backward, runs in fp32;
- `select`, `store_if`: a scalar-predicated choice and buffer write that keep no mask;
- `per_device`: a shard_map manual over the mesh axes that split a layout's tokens, the
  specs and rules that go with it (the loss, the lookup, the MoE layer, the Pallas kernel);
  `without`: a rules table with mesh axes dropped, the rules inside such a map;
- `unrolled_loops` / `unroll`: trace the loops unrolled, for FLOP checks of a schedule.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .mesh import DATA, EXPERT, REPLICATE, SEQ

TOKEN_AXES = (REPLICATE, DATA, EXPERT, SEQ)  # the mesh axes that split tokens

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


def without(rules, axes):
    """`rules` (a `sharding.Rules`) with the mesh `axes` dropped from every name: the rules
    inside a shard_map manual over them (`res_length` over (seq, tensor) keeps `tensor`, and
    `experts` goes whole where its `expert` axis is manual)."""
    def drop(v):
        left = tuple(a for a in (v if isinstance(v, tuple) else (v,)) if a and a not in axes)
        return left if len(left) > 1 else left[0] if left else None

    return rules.with_(**{name: drop(v) for name, v in rules.table})


@dataclass(frozen=True)
class PerDevice:
    """A shard_map manual over the axes that split a layout's tokens (`per_device`)."""

    mesh: object = None
    axes: tuple = ()  # the axes it goes manual over; none: no map, the code runs as it is
    tokens: tuple = ()  # the token axes manual inside: `axes`'s, and an enclosing map's
    rows: object = None  # the spec entries of a [B, T] array's two dims
    cols: object = None
    extra: tuple | None = None  # the axes that split the `extra` name (None: whole)
    inner: object = None  # the compute rules inside: `axes` dropped

    def spec(self, *rest) -> P:
        """The spec of a [B, T, ...] array: its tokens split, `rest` for the other dims."""
        return P(self.rows, self.cols, *rest)

    def __call__(self, fn, in_specs, out_specs, **kwargs):
        """`fn` as a per-device view over `axes` (`fn` itself where there are none)."""
        if not self.axes:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(self.axes), **kwargs)


def per_device(layout, x=None, extra: str | None = None) -> PerDevice:
    """The shard_map that runs code per device over the mesh axes that split the tokens in
    `layout` (a `sharding.Layout`, or None: no map), the batch's and the length's of size > 1,
    and, with `extra`, those that split that logical name as well (`kv_heads`, `mlp`,
    `vocab`). Inside another shard_map (a pipeline's: `x`, the code's token array, varies
    over its manual axes) the axes it made manual stay so and count among `tokens`, and
    `extra` stays automatic: a shard_map of its own, nested in ZB-H1's per-stage branches,
    does not lower; a layout without a mesh (inside one) maps over the context mesh."""
    if layout is None:
        return PerDevice()
    mesh = layout.mesh or jax.sharding.get_abstract_mesh()
    rows, cols = (layout.splitting(n, mesh) for n in ("batch", "length"))
    outer = varying(jax.typeof(x)) if x is not None else frozenset()
    extra = None if extra is None or outer else layout.splitting(extra, mesh)
    tokens = (rows or ()) + (cols or ())
    axes = tokens + (extra or ())
    return PerDevice(mesh, axes, tokens + tuple(a for a in outer if a in TOKEN_AXES), rows,
                     cols, extra, without(layout.compute, axes))
