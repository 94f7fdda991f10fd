"""Projection taps: how a zero-bubble schedule splits a layer's backward into B and W.

B is the input's gradient (the stage before waits for it), W the weights' gradient (nobody
waits for it). `Taps` adds a zero input to each projection's output and records the
projection's input; differentiating a layer with respect to (x, the zeros) and not the weights
gives B with the projections' output cotangents, and `split(model, attend)` gives what
`pipeline.worker` needs to take W later from (input, cotangent) pairs.
"""

from __future__ import annotations

import jax
from flax import nnx


class Taps:
    """What a zero-bubble schedule needs to split a layer's backward into the input gradient
    (B) and the weight gradient (W). Each projection y = x · w adds `zeros[name]` (a zero
    input of y's shape) to its output and records its input x: differentiating the layer with
    respect to (x, zeros) but not w gives B, the projections' output cotangents dy among its
    results, and XLA drops the x^T dy products nobody reads; W is later the vjp of the
    projections alone at (x, dy) (`split`). With `zeros=None` the
    outputs themselves are recorded instead (to learn their shapes)."""

    def __init__(self, zeros: dict | None = None):
        self.zeros, self.inputs, self.outputs = zeros, {}, {}

    def project(self, name: str, x, y):
        self.inputs[name] = x
        if self.zeros is None:
            self.outputs[name] = y
            return y
        return y + self.zeros[name]


def split(model, attend):
    """(tap_shapes, projection_grads, projection weight names) of `model`'s layers:
    `tap_shapes(params, x, rope) -> {projection: ShapeDtypeStruct of its output}` for one
    layer's params; `projection_grads(params, inputs, d_outputs) -> grads`, W: the gradient of
    one layer's projection weights from their inputs and their outputs' cotangents (zeros for
    the other leaves, the norm scales, whose gradient comes with B)."""
    graphdef = nnx.graphdef(model.blocks)

    def tap_shapes(params, x, rope):
        def outputs(params, x):
            taps = Taps()
            nnx.merge(graphdef, params)(x, *rope, attend, taps)
            return taps.outputs

        return jax.eval_shape(outputs, params, x)

    def projection_grads(params, inputs, d_outputs):
        def outputs(params):
            block = nnx.merge(graphdef, params)
            return {k: block.project(k, inputs[k]) for k in d_outputs}

        return jax.vjp(outputs, params)[1](d_outputs)[0]

    blocks = model.blocks
    weights = frozenset(w for m in (blocks.attn, blocks.mlp) for w, _ in m.PROJECTIONS.values())
    return tap_shapes, projection_grads, weights
