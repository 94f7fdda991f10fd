"""One stage's layers, as a schedule runs them: a chunk's forward keeping what its backward
needs, the backward adding each layer's weight gradient in place, and W.

A chunk runs layer by layer in a scan: each layer's forward is `jax.vjp` of the layer (under
its remat policy), its weights indexed in the stage's stack where they are used; what its
backward needs goes into the stash, stacked per layer, except the layer's weights and the RoPE
tables (a residual that *is* one of them is not copied). The backward scans the layers the
other way, rebuilds each vjp from the stash and the weights, and adds the layer's weight
gradient in place to the stage's fp32 accumulator: no chunk of weights or of gradients is ever
copied (the vjp of a whole chunk would hand back a fresh fp32 gradient of the chunk per pass).

Split (ZB-H1), the layer runs with zero taps added to its projections' outputs (`ops.Ops.tap`):
B differentiates it with respect to its input and the taps, whose cotangents are the
projections' output gradients dy, and W is later the vjp of the projections alone at (their
inputs, dy).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..manual import psum, vary, varying


class Layout(NamedTuple):
    """What one layer's vjp keeps, learned by tracing it once before any loop: its treedef,
    for each leaf the index of the known value it is (None: stashed), and the stashed leaves'
    shapes and the mesh axes each varies over."""
    treedef: object
    where: tuple
    shapes: list
    vma: list


def split_residuals(vjp_fn, known):
    """(residuals to stash, where): the vjp's leaves that are not one of `known`'s leaves (the
    layer's weights and the RoPE tables: a residual that is one is the very same value), and
    for each leaf the index of the known value it is (None: stashed)."""
    index = {id(w): k for k, w in enumerate(jax.tree.leaves(known))}
    leaves = jax.tree.leaves(vjp_fn)
    where = tuple(index.get(id(leaf)) for leaf in leaves)
    return [leaf for leaf, k in zip(leaves, where) if k is None], where


def rebuild(layout: Layout, stashed, known):
    """The vjp function of a stashed forward, its known values put back."""
    known, stashed = jax.tree.leaves(known), iter(stashed)
    return jax.tree.unflatten(layout.treedef, [next(stashed) if k is None else known[k]
                                               for k in layout.where])


def add_at(grads, d_w, k, chosen=lambda path: True):
    """`grads` with layer k's gradient `d_w` added in place, for the leaves `chosen(path)`."""
    def one(path, g, d):
        if not chosen(path):
            return g
        row = jax.lax.dynamic_index_in_dim(g, k, 0, False) + d.astype(g.dtype)
        return jax.lax.dynamic_update_index_in_dim(g, row, k, 0)

    return jax.tree_util.tree_map_with_path(one, grads, d_w)


def _is_projection(path, names) -> bool:
    """Whether the leaf at `path` (in a layer's params) is one of the projection weights
    `names` (`attn/w_qkv`, `before0/mlp/w_down`: not an MoE layer's experts, `mlp/w_down`)."""
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return any("/".join(keys[:i]) in names for i in range(1, len(keys) + 1))


class Worker:
    """Stage s's stack of v chunks of `depth` layers, per device inside the schedule's
    shard_map. `layer(params, x, consts, on[, zeros])` is one layer under its remat policy
    (with zero taps: also returning its projections' inputs); `split` the model's
    (tap_shapes, projection_grads, projection names) when the backward is split, else None."""

    def __init__(self, stack, consts, layer, depth: int, on, s, manual: tuple, split=None,
                 unrolled: bool = False):
        self.stack, self.consts, self.layer, self.depth = stack, consts, layer, depth
        self.on, self.s, self.unrolled = on, s, unrolled
        self.zeros, self.projections, self.layouts = None, frozenset(), {}
        if split is not None:
            tap_shapes, self.projection_grads, self.projections = split
            self.tap_shapes = tap_shapes
            self.manual = manual

    def weights(self, k):  # layer k of the stage's stack, indexed where it is used
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, 0, False), self.stack)

    def prepare(self, x0, split: bool) -> Layout:
        """Learn the layer's vjp layout (and, split, the taps' zeros) by tracing one layer."""
        if split and self.zeros is None:
            taps = self.tap_shapes(self.weights(0), x0, self.consts)
            self.zeros = {k: vary(jnp.zeros(t.shape, t.dtype), self.manual)
                          for k, t in taps.items()}
        if split not in self.layouts:
            found = []

            def one(x):
                stashed, where, treedef, _ = self._layer_vjp(0, x, split)
                found.append((treedef, where, [varying(jax.typeof(r)) for r in stashed]))
                return stashed

            shapes = jax.eval_shape(one, x0)
            (treedef, where, vma), = found
            self.layouts[split] = Layout(treedef, where, shapes, vma)
        return self.layouts[split]

    def _known(self, w, split, consts):
        return (w, consts, self.zeros) if split else (w, consts)

    def _layer_vjp(self, k, x, split, consts=None):
        """(stashed residuals, where, treedef, (y, projection inputs or None)) of layer k at
        x, with `consts` (default: those the worker was made with)."""
        w, consts = self.weights(k), self.consts if consts is None else consts
        on = None if self.on is None else self.on[self.s, k]
        if split:
            y, vjp_fn, inputs = jax.vjp(lambda w, x, z: self.layer(w, x, consts, on, z),
                                        w, x, self.zeros, has_aux=True)
        else:
            (y, vjp_fn), inputs = jax.vjp(lambda w, x: self.layer(w, x, consts, on),
                                          w, x), None
        stashed, where = split_residuals(vjp_fn, self._known(w, split, consts))
        return stashed, where, jax.tree.structure(vjp_fn), (y, inputs)

    def forward(self, x, c, split: bool = False, consts=None):
        """Chunk c's forward from x: (y, the residuals its layers' remat policy keeps, stacked
        per layer [depth, ...], and split, the projections' inputs stacked per layer), with
        the microbatch's `consts` (RoPE tables; packed documents' ids)."""
        layout = self.layouts[split]

        def body(x, j):
            stashed, where, _, (y, inputs) = self._layer_vjp(c * self.depth + j, x, split,
                                                             consts)
            assert where == layout.where, "the layer's residuals changed between traces"
            return y, (stashed, inputs)

        y, (stashed, inputs) = jax.lax.scan(body, x, jnp.arange(self.depth),
                                            unroll=self.unrolled)
        return y, stashed, inputs

    def backward(self, ct, residuals, c, grads, split: bool = False, consts=None):
        """Chunk c's backward, last layer first: (the input's cotangent, split: the taps'
        cotangents stacked per layer, `grads` with each layer's gradient added in place; split:
        all but the projections', which W adds); `consts` those of its forward."""
        layout = self.layouts[split]
        consts = self.consts if consts is None else consts
        keep = (lambda path: not _is_projection(path, self.projections)) if split else None

        def body(carry, j):
            ct, grads = carry
            k = c * self.depth + j
            stashed = [jax.lax.dynamic_index_in_dim(r, j, 0, False) for r in residuals]
            out = rebuild(layout, stashed, self._known(self.weights(k), split, consts))(ct)
            d_w, dx = out[:2]
            grads = add_at(grads, d_w, k, keep) if split else add_at(grads, d_w, k)
            return (dx, grads), (out[2] if split else None)

        (dx, grads), d_taps = jax.lax.scan(body, (ct, grads), jnp.arange(self.depth),
                                           reverse=True, unroll=self.unrolled)
        return dx, d_taps, grads

    def weight(self, inputs, d_taps, c, grads):
        """Chunk c's W: each layer's projection weights' gradient, added in place."""
        chosen = lambda path: _is_projection(path, self.projections)  # noqa: E731

        def body(grads, j):
            k = c * self.depth + j
            pick = lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False)  # noqa: E731
            d_w = self.projection_grads(self.weights(k), jax.tree.map(pick, inputs),
                                        jax.tree.map(pick, d_taps))
            return add_at(grads, d_w, k, chosen), None

        return jax.lax.scan(body, grads, jnp.arange(self.depth), unroll=self.unrolled)[0]


def head_grads(loss, head, labels, y, consts, i, last, manual):
    """If `last` (a forward the head follows): (loss, dloss/dy, dloss/dhead) of microbatch i's
    output y (`labels`: [m, ...] leaves; `loss(head, y, labels, consts)` its summed loss, with
    its layers' `consts`), else zeros."""
    m = jax.tree.leaves(labels)[0].shape[0]

    def pick(a):
        a = jax.lax.dynamic_index_in_dim(a, jnp.clip(i, 0, m - 1), 0, keepdims=False)
        return vary(jnp.where((i >= 0) & (i < m), a, -1), manual)  # -1: not counted

    lab = jax.tree.map(pick, labels)

    def compute():
        total, vjp_fn = jax.vjp(lambda h, y: loss(h, y, lab, consts), head, y)
        d_head, d_y = vjp_fn(jnp.ones_like(total))
        return total, d_y, d_head

    def skip():
        return (jnp.zeros_like(y, jnp.float32, shape=()), jnp.zeros_like(y),
                jax.tree.map(jnp.zeros_like, head))

    return jax.lax.cond(last, compute, skip)


def consts_of(consts, segments, mb):
    """What microbatch `mb`'s layers share: `consts`, the `Positions` of the RoPE tables, with
    packed documents (`segments`: None or the ids [m, mb, T]) its ids."""
    if segments is None:
        return consts
    mb = jnp.clip(mb, 0, segments.shape[0] - 1)
    return consts._replace(segments=jax.lax.dynamic_index_in_dim(segments, mb, 0, False))


def _sum_over(tree, manual: tuple, split):
    """Each leaf summed over the manual axes but those its `split` leaf names: one sum per
    set of axes."""
    leaves, treedef = jax.tree.flatten(tree)
    over = [tuple(a for a in manual if a not in own) for own in jax.tree.leaves(split)]
    for axes in set(over):  # one sum per set of axes (all of them but for split experts)
        which = [i for i, o in enumerate(over) if o == axes]
        for i, g in zip(which, psum([leaves[i] for i in which], axes)):
            leaves[i] = g
    return treedef.unflatten(leaves)


def stage_results(g_stack, g_head, total, dx_out, manual: tuple, axis: str, split, head_split):
    """What the per-stage function returns, its sums done: the stage's layer gradients summed
    over the manual axes but the stage's and those a weight is `split` over (once, after the
    loop), the head's over all of them but those its weight is `head_split` over (multi-token
    prediction's experts), the loss over all of them."""
    g_stack = _sum_over(g_stack, manual, split)
    return (psum(total, manual), jax.tree.map(lambda a: a[None], g_stack),
            _sum_over(g_head, manual, head_split), dx_out[None])
