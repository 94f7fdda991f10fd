"""What a layer takes from whoever runs it (`Ops`), and how a zero-bubble schedule splits a
layer's backward into B and W with it (`split`).

B is the input's gradient (the stage before waits for it), W the weights' gradient (nobody
waits for it). Tapped `Ops` add a zero input to each projection's output and record the
projection's input; differentiating a layer with respect to (x, the zeros) and not the weights
gives B with the projections' output cotangents, and `split(model, ops)` gives what
`pipeline.worker` needs to take W later from (input, cotangent) pairs.
"""

from __future__ import annotations

import copy

import jax
from flax import nnx


class Ops:
    """The one thing a layer receives from the code that runs it: `attend(q, k, v)`, the
    attention kernel (blocked, the ring, a gather of K and V, a KV cache), and `project(name,
    x, y)`, what becomes of each projection's output y = x . w. Plain, y itself. Tapped (`tap`)
    for a zero-bubble schedule: y plus `zeros[name]`, a zero input of y's shape, with x
    recorded in `inputs`; with `zeros=None`, the outputs are recorded instead (to learn their
    shapes).

    Decoding, `cache(x)` is given: `keep(x)` writes what attention keeps of the new positions
    (K and V; MLA's latent) into the cache and returns all of it, and `attend` takes the
    cached keys (`attend(q, k, v, scale=...)`); `cached` says so to a layer that attends in
    another form then (MLA, absorbed)."""

    def __init__(self, attend, zeros: dict | None = None, tapped: bool = False, cache=None):
        self.attend, self.zeros, self.tapped, self.cache = attend, zeros, tapped, cache
        self.inputs, self.outputs, self.prefix = {}, {}, ""

    def scoped(self, prefix: str) -> "Ops":
        """The same ops for a layer inside the one that has them (`model.moe_every`): its
        projections' names start with `prefix` (`before0/qkv`), everything else shared."""
        inner = copy.copy(self)
        inner.prefix = self.prefix + prefix
        return inner

    @property
    def cached(self) -> bool:
        return self.cache is not None

    def keep(self, x):
        """x[B, T, ...] as attention sees it: itself, or decoding, the cache it was written into."""
        return x if self.cache is None else self.cache(x)

    def tap(self, zeros: dict | None = None) -> "Ops":
        """Fresh tapped ops with the same kernel (one per traced layer call)."""
        return Ops(self.attend, zeros, tapped=True)

    def project(self, name: str, x, y):
        if not self.tapped:
            return y
        name = self.prefix + name
        self.inputs[name] = x
        if self.zeros is None:
            self.outputs[name] = y
            return y
        return y + self.zeros[name]


def split(model, ops: Ops):
    """(tap_shapes, projection_grads, projection weight names) of `model`'s layers:
    `tap_shapes(params, x, rope) -> {projection: ShapeDtypeStruct of its output}` for one
    layer's params; `projection_grads(params, inputs, d_outputs) -> grads`, W: the gradient of
    one layer's projection weights from their inputs and their outputs' cotangents (zeros for
    the other leaves, the norm scales, whose gradient comes with B)."""
    graphdef = nnx.graphdef(model.blocks)

    def tap_shapes(params, x, rope):
        def outputs(params, x):
            tapped = ops.tap()
            nnx.merge(graphdef, params)(x, rope, tapped)
            return tapped.outputs

        return jax.eval_shape(outputs, params, x)

    def projection_grads(params, inputs, d_outputs):
        def outputs(params):
            block = nnx.merge(graphdef, params)
            return {k: block.project(k, inputs[k]) for k in d_outputs}

        return jax.vjp(outputs, params)[1](d_outputs)[0]

    blocks = model.blocks  # the weights' paths in a layer: `attn/w_qkv`, `before0/mlp/w_down`
    layers = [("", blocks)] + [(f"before{j}/", getattr(blocks, f"before{j}"))
                               for j in range(blocks.before)]
    weights = frozenset(f"{pre}{name}/{w}" for pre, b in layers
                        for name in ("attn", "mlp")
                        for w, _ in getattr(b, name).PROJECTIONS.values())
    return tap_shapes, projection_grads, weights
