"""A layer's bytes per token, asked of the layer itself rather than restated: what its backward
keeps under a remat policy, and its projections' inputs and outputs.

`of(plan)` traces one layer (`Transformer.layer`, the code the step runs) at one device's share
of it -- its heads, kv heads and MLP columns under tensor parallelism, its tokens under the ring
-- with the attention kernel the plan runs, on abstract shapes: no devices, nothing allocated.
What `jax.vjp` hands over for the backward is the residuals; traced at a symbolic row count,
their sizes are polynomials in it, and the difference between one row and two leaves what grows
with the tokens (the weights and the RoPE tables drop out). A layer whose code needs the count
itself (the MoE layer's capacity) is traced at one row and at two. The kernels as traced:

* blocked, ring, gather: their per-device code (`ring.py`; the blocked kernel is the ring's
  on a ring of one) under a named axis of the `seq` degree;
* cudnn, pallas (no GPU here to trace them on): a flash kernel's contract -- it keeps q, k, v,
  its output and fp32 row statistics, and no scores -- which is exactly what the blocked
  kernel keeps, so that is what is traced.

Under sequence parallelism the residual stream is split over `tensor` (`res_length`): the
norms run on it, and the row-parallel projections (those whose output is the model width) are
reduce-scattered straight into it. What the layer keeps from its input, inside its norms and of
those projections' outputs (found by their `named_scope`s) is counted at 1/tensor; the rest of
the layer runs on the gathered sequence.

The projections' outputs (`Ops.project`'s taps) are the cotangents a layer's backward holds at
once, and with their inputs what a zero-bubble schedule's W waits for.

Cached per distinct layer, so a search of thousands of layouts traces each a few times, and
each remat policy's residuals when first asked for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

REMATS = ("none", "save_dots", "full", "offload", "offload_dots")


def _as_the_step(ep: int = 1):
    """The context the step traces its layers in: activation rules active (on a mesh of one
    device per axis, but `ep` over `expert` for expert parallelism), so the layer's sharding
    constraints and its weights' relayouts are the step's own values (a constrained copy is a
    value the backward may keep)."""
    from contextlib import ExitStack

    import jax

    from ..grouped import standing_in
    from ..mesh import Degrees, abstract_mesh
    from ..sharding import activation_rules, zero_rules
    stack = ExitStack()
    stack.enter_context(jax.sharding.use_abstract_mesh(abstract_mesh(Degrees(expert=ep).sizes())))
    stack.enter_context(activation_rules(zero_rules(0, False, expert=ep > 1).compute, None))
    stack.enter_context(standing_in())  # a GPU plan's experts kernel: its buffers, traced here
    return stack


@dataclass(frozen=True)
class Residual:
    """One value the backward is handed, per token of one device."""

    nbytes: float
    stream: bool  # from the residual stream or a norm: split over tensor under SP
    host: bool = False  # kept in host memory (an offloading policy's): no device bytes
    made: bool = True  # made by the layer (not one of its inputs: the weights as stored, x)
    experts: bool = False  # made in the MoE layer's experts (their `named_scope`)
    attention: bool = False  # made in the layer's attention block (its `named_scope`)


class _PerPolicy(dict):
    """remat policy -> its value (its residuals, traces, ...), each made when first asked for:
    an estimate asks two or three of the five, a search all of them."""

    def __init__(self, trace):
        super().__init__()
        self._trace = trace

    def __missing__(self, policy):
        if policy not in REMATS:
            raise KeyError(policy)
        self[policy] = self._trace(policy)
        return self[policy]


@dataclass(frozen=True)
class LayerBytes:
    """Bytes per token of one layer on one device (see the module's docstring)."""

    residuals: dict  # remat policy -> tuple of Residual (`_PerPolicy`)
    projection_inputs: float
    projection_outputs: float
    stream_inputs: float  # of the projections' inputs, those from the stream (a norm's)
    # remat policy -> bytes per device of what the vjp hands over that the layer makes and
    # that does not grow with the tokens (a custom_vjp's residuals, which no policy sees: the
    # experts' weights as used), which a stashing schedule keeps per pass
    fixed: dict
    # ... and of it what a scan of layers without a pipeline stacks for its backward: the
    # experts' (the grouped matmul's residuals, which XLA must keep); a dense layer's casts of
    # its weights XLA makes again where the backward's matmuls use them
    fixed_kept: dict

    def on_host(self, policy: str, tensor_split: int = 1) -> float:
        """What an offloading `policy` keeps in host memory instead (0 for the others)."""
        return sum(r.nbytes / (tensor_split if r.stream else 1) for r in self.residuals[policy]
                   if r.host)

    def kept(self, policy: str, tensor_split: int = 1, attention: bool | None = None) -> float:
        """What autodiff's backward keeps in device memory under `policy` (what `jax.vjp`
        hands over, which 1F1B and ZB-H1 stash); `attention`: of it, what the attention
        block makes (True) or the rest (False)."""
        return sum(r.nbytes / (tensor_split if r.stream else 1) for r in self.residuals[policy]
                   if not r.host and attention in (None, r.attention)
                   and (attention is not False or r.made))

    def waits(self, tensor_split: int = 1) -> float:
        """What a zero-bubble schedule's W waits for: the projections' inputs (a norm's output
        as it was before SP's gather, which W gathers again) and their outputs' cotangents."""
        return (self.projection_inputs - self.stream_inputs * (1 - 1 / tensor_split)
                + self.projection_outputs)


def of(plan, dense: bool = False) -> LayerBytes:
    """The plan's layer on one device (see the module's docstring); `dense`: a layer of the
    dense stack before the main one (`model.dense_layers`)."""
    m, deg = plan.cfg.model, plan.degrees
    t, seq, ep = deg.tensor, deg.seq, deg.expert
    local = replace(m, num_layers=m.moe_every, dense_layers=0, vocab_size=8,
                    head_dim=m.head_dim if m.is_mla else m.dim_per_head,  # not D / (H / t)
                    num_heads=m.num_heads // t, num_kv_heads=m.num_kv_heads // t,
                    d_ff=m.d_ff // t, d_ff_expert=m.expert_width // t)
    if dense:
        local, ep = replace(local.dense_kind, num_layers=1), 1
    return _trace(local, plan.cfg.train.seq_len // seq, plan.attention, seq, ep,
                  plan.attention_local)


@functools.lru_cache(maxsize=256)
def _trace(m, tokens: int, kernel: str, seq: int, ep: int = 1, inner: str = "") -> LayerBytes:
    """Per device; under expert parallelism the layer is traced on `ep` devices over
    `expert` (its MoE block gathers their tokens) and its values' bytes divided by `ep`;
    Ulysses (`kernel`) with the kernel it runs over the whole sequence (`inner`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ..model import abstract_model
    from ..ops import Ops
    from ..ring import gathered_attention_local, ring_attention_local
    from ..ulysses import ulysses_local

    from ..mesh import SEQ

    axis = SEQ
    flash = lambda q, k, v, *_: ring_attention_local(q, k, v, axis, 1)  # noqa: E731
    local = {"blocked": flash, "cudnn": flash, "pallas": flash}
    attend = {**local,
              "ring": lambda q, k, v: ring_attention_local(q, k, v, axis, seq),
              "gather": lambda q, k, v: gathered_attention_local(q, k, v, axis, seq),
              "ulysses": lambda q, k, v: ulysses_local(q, k, v, axis, seq,
                                                       local.get(inner, flash))}[kernel]
    env = [(axis, seq if kernel in ("ring", "gather", "ulysses") else 1)]
    model = nnx.merge(*abstract_model(m))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                          nnx.state(model.blocks))
    rope = model.rope(np.arange(tokens))
    ops = Ops(attend)

    def x(rows):
        return jax.ShapeDtypeStruct((rows * ep, tokens, m.d_model), jnp.dtype(m.dtype))

    def vjp(policy):
        layer = model.layer(policy, ops)
        return lambda p, x: jax.vjp(lambda p, x: layer(p, x, rope), p, x)[1]

    def run(p, x):
        tapped = ops.tap()
        nnx.merge(nnx.graphdef(model.blocks), p)(x, rope, tapped)
        return tapped.inputs, tapped.outputs

    def traced(fn):  # `_at_rows` of fn on the layer's weights and `rows` rows of x
        def trace(rows):
            with _as_the_step(ep):
                return jax.make_jaxpr(fn, axis_env=env, return_shape=True)(params, x(rows))
        return _at_rows(trace)

    vjps = _PerPolicy(lambda policy: traced(vjp(policy)))

    @functools.cache
    def residuals(policy, rows):
        jaxpr, _, at = vjps[policy](rows)
        return _describe(jaxpr.jaxpr, at)

    def per_token(policy):
        one, two = residuals(policy, 1), residuals(policy, 2)
        return tuple(Residual((b - a.nbytes) / tokens / ep, a.stream, a.host, a.made,
                              attention=a.attention)
                     for a, (b) in zip(one, (r.nbytes for r in two)) if b > a.nbytes)

    def fixed(policy, experts=False):  # made by the layer, the same at any rows: per device
        one, two = residuals(policy, 1), residuals(policy, 2)
        return sum(a.nbytes for a, b in zip(one, two) if a.made and not a.host
                   and b.nbytes == a.nbytes and (a.experts or not experts)) / ep

    taps = traced(run)

    def size(rows):  # (inputs, outputs, of the inputs those from the stream)
        jaxpr, (ins, _), at = taps(rows)
        values = _describe(jaxpr.jaxpr, at, through=("sharding_constraint",))
        first = len(jax.tree.leaves(ins))
        return (sum(r.nbytes for r in values[:first]), sum(r.nbytes for r in values[first:]),
                sum(r.nbytes for r in values[:first] if r.stream))

    one, two = size(1), size(2)
    per = tokens * ep
    inputs, outputs, stream = ((b - a) / per for a, b in zip(one, two))
    return LayerBytes(_PerPolicy(per_token), inputs, outputs, stream,
                      _PerPolicy(fixed), _PerPolicy(lambda p: fixed(p, experts=True)))


def _at_rows(trace):
    """rows -> (jaxpr, output shapes, size -> its value at that many rows) from `trace(rows)`:
    one trace at a symbolic row count (each size a polynomial in it), where two traces at one
    and two rows took a quarter longer (`plan --search` on 8 devices: 35 s to 28 s), or, where
    the layer's code needs the count itself (the MoE layer's capacity) or a size is not linear
    in it, one trace per count asked for. A symbolic trace also hands over a few int32 scalars
    (indices) that a concrete one folds into constants: bytes, not megabytes."""
    import jax

    try:
        rows, = jax.export.symbolic_shape("rows")
        jaxpr, shapes = trace(rows)
        sizes = [v.aval.size for v in jaxpr.jaxpr.outvars]
        linear = {str(n): _linear(str(n)) for n in sizes + [a.size for a in
                                                            jax.tree.leaves(shapes)]}
    except (TypeError, ValueError, NotImplementedError,
            jax.errors.InconclusiveDimensionOperation, jax.errors.ConcretizationTypeError):
        return functools.cache(lambda n: (*trace(n), lambda size: size))
    return lambda n: (jaxpr, shapes, lambda size: (lambda a, b: a * n + b)(*linear[str(size)]))


def _linear(size: str) -> tuple[int, int]:
    """(a, b) of a size `a*rows + b` as jax prints it (exact Python ints: jax's own evaluation
    of a polynomial takes its coefficients as int32); ValueError for anything else."""
    import re

    if not re.fullmatch(r"[0-9*+\- ]+", size.replace("rows", "1")):  # floordiv, rows^2, ...
        raise ValueError(size)
    at = lambda n: eval(size, {"__builtins__": {}}, {"rows": n})  # noqa: E731, S307
    return at(1) - at(0), at(0)


def _stream_scopes() -> frozenset:
    """The named scopes whose values live in the residual stream under SP: the norms, and the
    row-parallel projections (their output is the model width: `PROJECTIONS` specs that end
    in `btd`)."""
    from ..mla import LatentAttention
    from ..model import MLP, Attention

    rows = {name for cls in (Attention, LatentAttention, MLP)
            for name, (_, spec) in cls.PROJECTIONS.items()
            if spec.endswith("->btd")}
    return frozenset({"norm", *rows})


def _describe(jaxpr, at, through: tuple = ()) -> list[Residual]:
    """The residuals a vjp's closure holds (the traced function's outputs), in order; `at`:
    a traced size's value (`_at_rows`); each value found where it was made, past an offload
    or a name and the primitives `through` (a projection's input: past SP's gather)."""
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    stream_scopes = _stream_scopes()
    out = []
    for v in jaxpr.outvars:
        aval, eqn = v.aval, made.get(v)
        while eqn is not None and eqn.primitive.name in ("device_put", "name", *through):
            eqn = made.get(eqn.invars[0])  # its value: where it was made
        scopes = set(str(eqn.source_info.name_stack).split("/")) if eqn is not None else set()
        within = lambda name: any(c.endswith((name, f"({name})")) for c in scopes)  # noqa: E731
        out.append(Residual(float(at(aval.size) * aval.dtype.itemsize),
                            stream=eqn is None or bool(scopes & stream_scopes),
                            host=str(getattr(aval, "memory_space", "")).endswith("Host"),
                            made=eqn is not None,
                            experts=within("experts"), attention=within("attention")))
    return out
