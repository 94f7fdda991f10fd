"""Logical axis names -> mesh axes: the one rules table, and ZeRO as variations of it.

Modules annotate parameters and activations with logical names only (`embed`, `mlp`, ...).
`Rules` maps them to mesh axes. The ZeRO stages differ only in which tables parameters,
gradients and optimizer state use:

| ZeRO | parameters            | gradients             | optimizer state        |
|------|-----------------------|-----------------------|------------------------|
| 0    | compute               | compute               | compute                |
| 1    | compute               | compute               | + `embed` over `data`  |
| 2    | compute               | + `embed` over `data` | + `embed` over `data`  |
| 3    | + `embed` over `data` | + `embed` over `data` | + `embed` over `data`  |

Sharding gradients over `data` turns their all-reduce into a reduce-scatter; sharding the
parameters makes XLA all-gather each layer's weights inside the layer scan (FSDP).

Expert parallelism (`expert=True`) is folded into the data-parallel devices: the mesh splits
them as `data` x `expert`, the batch and ZeRO's `embed` take both (a dense layer sees the same
data-parallel group either way), and the experts' dim (`experts`) takes `expert` alone, so an
expert's weights are ZeRO-sharded over the replicas left (`expert_embed` over `data`). Without
it `experts` is unsplit and `expert_embed` is `embed`.
"""

from __future__ import annotations

import contextvars
import functools
from contextlib import contextmanager
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from .mesh import DATA, EXPERT, REPLICATE, SEQ, STAGE, TENSOR
from .store import flat
from .units import columns

ACTIVATION_NAMES = ("batch", "length", "res_length")  # never on a parameter
LOGICAL_NAMES = (
    "batch", "length", "res_length", "embed", "heads", "kv_heads", "q_per_kv", "head_dim",
    "mlp", "vocab", "layers", "gate_up", "norm",
    # MoE: an expert weight's expert dim and its d_model dim; a router's expert dim (never split)
    "experts", "expert_embed", "routes",
    # FP8 scaling state: a projection's amax histories and probes (fp8.py; never split)
    "fp8",
    # MLA (mla.py): a latent's width where it is made (never split), and as an up
    # projection's input dim (ZeRO's, as `embed` is for the rest)
    "latent", "latent_embed",
    # the stacks of dense layers before the main one (DeepSeek's first k) and of multi-token
    # prediction's depths after it: never split
    "dense", "mtp",
)


def mesh_axes(axes) -> tuple:
    """A rule's value (None, one mesh axis or a tuple of them) as a tuple of mesh axes."""
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def flat_axes(*axes) -> tuple:
    """Rule values (None, a mesh axis or a tuple of them) as one tuple of mesh axes."""
    return tuple(b for a in axes for b in mesh_axes(a))


def stack_specs(blocks, axis: str | None, lead: int, manual):
    """PartitionSpecs of the stacked layers [p, <lead dims>, ...] for a shard_map manual over
    `manual` (a pipeline's): split over the stage axis, and an expert weight's `experts` dim
    over the expert axis where that is manual too (each device keeps its own experts). With
    `axis` None, of a stack every stage uses whole (a pipeline's head's: multi-token
    prediction's depths), beside which a leaf that is no Variable is whole too."""
    def one(v):
        if not isinstance(v, nnx.Variable):
            return P()
        names = v.get_metadata("axes")[1:]  # after `layers` (or the stack's own name)
        split = [EXPERT if n == "experts" and EXPERT in manual else None for n in names]
        return P(axis, *([None] * lead), *split)

    return jax.tree.map(one, blocks, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclass(frozen=True)
class Rules:
    """A table from logical names to a mesh axis (or a tuple of axes, or None = replicated)."""

    table: tuple  # ((logical name, mesh axes), ...): frozen, hashable
    # mesh axes a name takes only where no earlier dim of the array took them: `stage` for
    # the tables outside a pipeline (`zero_rules`), which the stacked layers' `layers` holds
    spare: tuple = ()

    def __getitem__(self, name):
        for k, v in self.table:
            if k == name:
                return v
        raise KeyError(name)

    def spec(self, names) -> P:
        """PartitionSpec for a tuple of logical names; unknown names and reused axes raise
        (but a spare axis an earlier dim took is dropped)."""
        return self._spec(tuple(names))

    @functools.lru_cache(maxsize=4096)  # the planner asks it per array of every layout it weighs
    def _spec(self, names: tuple) -> P:
        out, used = [], set()
        for n in names:
            if n is None:
                out.append(None)
                continue
            if n not in LOGICAL_NAMES:
                raise ValueError(f"unknown logical axis name {n!r} in {names}")
            flat = tuple(a for a in mesh_axes(self[n]) if not (a in self.spare and a in used))
            axes = flat if len(flat) > 1 else flat[0] if flat else None
            if used & set(flat):
                raise ValueError(f"mesh axis used twice in {names}: {used & set(flat)}")
            used |= set(flat)
            out.append(axes)
        return P(*out)

    def with_(self, **changes) -> "Rules":
        return Rules(tuple((k, changes.get(k, v)) for k, v in self.table), self.spare)


def compute_rules(sequence_parallel: bool = False, expert: bool = False,
                  replicate: bool = False) -> Rules:
    """How activations and (ZeRO-0) parameters are laid out while the model runs.

    `res_length` is the sequence dim of the residual stream, where the norms run: with
    Megatron sequence parallelism it is also split over `tensor`, so XLA turns each
    row-parallel all-reduce into a reduce-scatter and gathers again before the next matmul.
    The batch is split over every data-parallel axis: `replicate` (HSDP), `data`, `expert`."""
    batch = (REPLICATE,) * replicate + (DATA,) + (EXPERT,) * expert
    return Rules((
        ("batch", batch if len(batch) > 1 else DATA),
        ("length", SEQ),
        ("res_length", (SEQ, TENSOR) if sequence_parallel else SEQ),
        ("embed", None),
        ("heads", TENSOR),
        ("kv_heads", TENSOR),
        ("q_per_kv", None),
        ("head_dim", None),
        ("mlp", TENSOR),
        ("vocab", TENSOR),
        ("layers", STAGE),
        ("gate_up", None),
        ("norm", None),
        ("experts", EXPERT if expert else None),
        ("expert_embed", None),
        ("routes", None),
        ("fp8", None),
        ("latent", None),
        ("latent_embed", None),
        ("dense", None),
        ("mtp", None),
    ))


@dataclass(frozen=True)
class ZeroRules:
    """The tables for one ZeRO stage."""

    compute: Rules
    params: Rules
    grads: Rules
    opt: Rules

    def canonical(self) -> "ZeroRules":
        """Tables for the canonical [L, ...] stack when the stored one is padded (uneven
        stages): L does not split over `stage` evenly, so `layers` stays whole and `embed` and
        `norm` (the model width, in every stacked parameter) take `stage` as well. Used to hand
        checkpoints their canonical arrays, per device no larger than the stored ones."""
        def plus(axes):  # (the tables outside a pipeline may hold it already)
            return axes if STAGE in mesh_axes(axes) else flat_axes(axes, STAGE)

        def add_stage(rules: Rules) -> Rules:  # (spare: an array with both widths, MTP's
            # `eh_proj`, splits the first)
            changed = rules.with_(layers=None, embed=plus(rules["embed"]), norm=plus(rules["norm"]))
            return Rules(changed.table, tuple(dict.fromkeys(rules.spare + (STAGE,))))

        return ZeroRules(self.compute, add_stage(self.params), add_stage(self.grads),
                         add_stage(self.opt))

    @staticmethod
    def _over_batch(rules: Rules) -> bool:  # a parameter's name split over `data` (ZeRO's axis)
        return any(DATA in mesh_axes(v) for k, v in rules.table if k not in ACTIVATION_NAMES)

    @property
    def params_over_batch(self) -> bool:
        """Whether stored weights are split over the ZeRO group's axis (ZeRO-3)."""
        return self._over_batch(self.params)

    @property
    def grads_over_batch(self) -> bool:
        """Whether gradients are split over it (ZeRO-2/3; ZeRO-1 accumulating: `Plan.of`)."""
        return self._over_batch(self.grads)


def zero_rules(zero_stage: int, sequence_parallel: bool = False,
               expert: bool = False, replicate: bool = False,
               over_stage: bool = False) -> ZeroRules:
    """The tables for `zero_stage`: it shards over a group, `data` (and `expert`), never over
    HSDP's `replicate`: each group holds a whole copy.

    `over_stage` (a pipeline): the weights used outside it -- the embedding, the head, the
    dense layers before the stack -- are stored and their gradients reduced split over
    `stage` too, by `embed` (the stacked layers' `layers` holds `stage` already, so they keep
    their split): each stage holds 1/p of them, gathered where they are used (`use_param`),
    and their gradients are reduce-scattered instead of all-reduced over the stages that all
    use them. Optimizer state keeps its ZeRO group (a group of data x stage seldom divides
    the width)."""
    base = compute_rules(sequence_parallel, expert, replicate)
    zero = (DATA, EXPERT) if expert else DATA
    sharded = base.with_(embed=zero, latent_embed=zero, expert_embed=DATA)

    def spread(rules: Rules) -> Rules:
        if not over_stage:
            return rules
        axes = flat_axes(rules["embed"], STAGE)
        return Rules(rules.with_(embed=axes if len(axes) > 1 else STAGE).table, (STAGE,))

    return ZeroRules(
        compute=base,
        params=spread(sharded if zero_stage >= 3 else base),
        grads=spread(sharded if zero_stage >= 2 else base),
        opt=sharded if zero_stage >= 1 else base,
    )


# ---------------------------------------------------------------------------------------------
# parameters: logical names live in the `axes` metadata of each nnx.Variable

class Param(nnx.Param):
    """A parameter whose `axes` metadata names its dims logically, e.g. ("embed", "mlp").

    Stacking with nnx.vmap/nnx.scan (`transform_metadata={nnx.PARTITION_NAME: "layers"}`)
    inserts the new dim's name, so the stacked blocks read ("layers", "embed", "mlp").
    """

    def add_axis(self, index: int, name) -> None:
        axes = list(self.get_metadata("axes"))
        axes.insert(index, name)
        self.set_metadata("axes", tuple(axes))

    def remove_axis(self, index: int, name) -> None:
        axes = list(self.get_metadata("axes"))
        axes.pop(index)
        self.set_metadata("axes", tuple(axes))


def shardings_for(tree, rules: Rules, mesh):
    """NamedShardings for a pytree, in its exact structure (Variables stay Variables, holding a
    sharding): Variables by their logical `axes`, other leaves (step counters) replicated."""

    def one(x):
        if isinstance(x, nnx.Variable):
            sharding = NamedSharding(mesh, rules.spec(x.get_metadata("axes")))
            return jax.tree.map(lambda _: sharding, x)
        return NamedSharding(mesh, P())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# ---------------------------------------------------------------------------------------------
# inside the step: activations and parameter uses follow the rules of the current trace

@dataclass(frozen=True)
class Layout:
    compute: Rules  # activations, and parameters where they are used
    grads: Rules  # parameter cotangents
    mesh: object  # a Mesh, or None for the context mesh (inside a shard_map)
    params: Rules | None = None  # parameters as stored, where they are cast (None: anywhere)

    def sharding(self, spec: P):
        return spec if self.mesh is None else NamedSharding(self.mesh, spec)

    def splitting(self, name: str, mesh=None):
        """The mesh axes that logical `name` takes under the compute rules and that split
        it (size > 1 on `mesh`, default this layout's), or None: a shard_map's spec entry."""
        mesh = mesh or self.mesh
        return tuple(a for a in mesh_axes(self.compute[name]) if mesh.shape[a] > 1) or None


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("spmd3d_layout", default=None)


@contextmanager
def activation_rules(rules: Rules | None, mesh=None, grads: Rules | None = None,
                     params: Rules | None = None):
    """While tracing inside this block, `constrain` and `use_param` lay arrays out by `rules`
    (gradients by `grads`, default `rules`; parameters cast to the compute dtype where
    `params` stores them) on `mesh`. Without it both are no-ops, so the model also runs
    unsharded (one device, a notebook)."""
    token = _ACTIVE.set(None if rules is None else Layout(rules, grads or rules, mesh, params))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_layout() -> Layout | None:
    return _ACTIVE.get()


def constrain(x, names):
    """Pin activation `x` to the layout its logical `names` map to; a no-op without rules."""
    layout = _ACTIVE.get()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.sharding(layout.compute.spec(names)))


def _relayout(dtype, fwd, bwd, stored=None):
    """Identity up to a cast, laid out `fwd`; its cotangent is cast back and laid out `bwd`.
    With `stored`, the cast happens in that layout, before any gather to `fwd`."""

    @jax.custom_vjp
    def relayout(x):
        y = x.astype(dtype)
        if stored is not None:
            y = jax.lax.with_sharding_constraint(y, stored)
        return jax.lax.with_sharding_constraint(y, fwd)

    def relayout_fwd(x):
        return relayout(x), jnp.zeros((), x.dtype)

    def relayout_bwd(x_dtype_witness, ct):
        return (jax.lax.with_sharding_constraint(ct.astype(x_dtype_witness.dtype), bwd),)

    relayout.defvjp(relayout_fwd, relayout_bwd)
    return relayout


def use_param(value, names, dtype):
    """A stored parameter as used by a matmul: cast to the compute dtype and laid out by the
    compute rules (under ZeRO-3 this is the per-layer all-gather, in the compute dtype); its
    gradient goes straight to the gradient layout in the parameter's dtype (under ZeRO-2/3 a
    reduce-scatter per layer, inside the backward layer loop, instead of a full all-reduce).
    Inside the layer scan the leading `layers` name is dropped to match the sliced value."""
    layout = _ACTIVE.get()
    if layout is None:
        return value.astype(dtype)
    names = tuple(names)[len(names) - value.ndim:]
    fwd = layout.sharding(layout.compute.spec(names))
    bwd = layout.sharding(layout.grads.spec(names))
    # cast where stored, then gathered: left to sharding propagation, the cast followed the
    # gather and ZeRO-3 gathered fp32 weights, twice the bytes of the compute dtype's
    stored = None if layout.params is None else layout.sharding(layout.params.spec(names))
    return _relayout(dtype, fwd, bwd, stored if stored != fwd else None)(value)


_LAYOUT_PRIMITIVES = frozenset({"convert_element_type", "sharding_constraint"})


def is_param_relayout(prim, params) -> bool:
    """True for the equation `use_param` leaves in a jaxpr (a custom_vjp doing nothing but
    casts and sharding constraints): remat policies use it to never save weights as used."""
    if prim.name != "custom_vjp_call":
        return False
    return all(e.primitive.name in _LAYOUT_PRIMITIVES for e in params["call_jaxpr"].jaxpr.eqns)


def describe(params, rules: "ZeroRules", mesh) -> list[dict]:
    """Where every parameter lives: one row per parameter with its path, global shape, logical
    names, mesh axes (compute / stored / optimizer state) and the per-device shape it stores."""
    rows = []
    for key, var in flat(params, is_leaf=lambda x: isinstance(x, nnx.Variable)).items():
        names = var.get_metadata("axes")
        stored = NamedSharding(mesh, rules.params.spec(names))
        rows.append({
            "param": key,
            "shape": tuple(var.shape),
            "logical": names,
            "compute": tuple(rules.compute.spec(names)),
            "stored": tuple(rules.params.spec(names)),
            "opt_state": tuple(rules.opt.spec(names)),
            "local_shape": stored.shard_shape(tuple(var.shape)),
        })
    return rows


PARAM_COLUMNS = ("param", "shape", "logical", "stored", "opt_state", "local_shape")


def format_table(rows: list[dict]) -> str:
    """`describe`'s rows as the aligned table `--explain` and `Experiment.params_table` print."""
    return "\n".join(columns([[r[c] for c in PARAM_COLUMNS] for r in rows], PARAM_COLUMNS))
