"""Mixture-of-Experts on the mesh, all but the parameters (`model.MoE` holds those) and the
router (`router.py`): each token through its chosen experts, dropless (`grouped_ffn`) or in
fixed capacity buffers (`capacity_ffn`; with the experts split, moved by two
all-to-alls), on the devices that hold them (`experts_layer`), and what that moves
(`traffic`, the planner's). docs/moe.md has the design.

Shapes: tokens x[N, D] (flattened), their experts and weights [N, k]; the experts' weights
gate_up[E, D, 2, F] and down[E, F, D] (E_local of them on a device).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import grouped
from .manual import all_gather, per_device, psum, psum_scatter, vary
from .mesh import EXPERT, TENSOR
from .sharding import current_layout
from .router import Routing, balanced, choose, weigh


def grouped_ffn(x_nd, gate_up_edcf, down_efd, weights_nk, experts_nk, first: int = 0,
                kernel: str = "ragged", weight_grad: str = "xla", prepare=None):
    """y[N, D]: each token through its chosen experts among the local ones (global ids
    first .. first + E_local - 1), weighted; others contribute zero. Dropless: the N k
    assignments sorted by expert, grouped matmuls (`grouped.matmul(kernel, weight_grad,
    prepare)`: `prepare` makes the weights as used) over the groups, then put back in token
    order and summed over each token's k."""
    ragged_dot = grouped.matmul("ragged" if kernel == "auto" else kernel,
                                "xla" if weight_grad == "auto" else weight_grad, prepare)
    n, k = experts_nk.shape
    e_local, d = gate_up_edcf.shape[0], x_nd.shape[-1]
    local = experts_nk.reshape(-1) - first
    mine = (local >= 0) & (local < e_local)
    key = jnp.where(mine, local, e_local)  # the other devices' assignments sort last
    # a token chooses an expert once, so at most min(k, E_local) of its k are ours: the
    # buffers hold that many rows per token, not k (half of them at Mixtral's top-2, one
    # expert per device)
    order = jnp.argsort(key, stable=True)[:n * min(k, e_local)]
    sizes = jnp.zeros((e_local + 1,), jnp.int32).at[key].add(1)[:e_local]
    rows = x_nd[order // k]  # [R, D], grouped by expert
    # gate and up as the weights' pair axis (`grouped`): merging [2, F] into one dim would move
    # F's shards (over `tensor`), and slicing it here would keep a copy of each for the backward
    gate_up = ragged_dot(rows, gate_up_edcf, sizes)  # [R, 2, F]
    y = ragged_dot(_swiglu(gate_up), down_efd, sizes)  # [R, D]; 0 past the groups
    w = jnp.where(mine, weights_nk.reshape(-1), 0.0)[order].astype(y.dtype)
    return jnp.zeros((n, d), y.dtype).at[order // k].add(y * w[:, None])


def capacity(factor: float, assignments: int, num_experts: int) -> int:
    """Assignments an expert takes at most: `factor` x its even share (at least 1)."""
    return max(1, math.ceil(factor * assignments / num_experts))


def slots(experts_nk, first: int, e_local: int, cap: int):
    """(slot[N, k]: local expert x cap + its rank among the expert's assignments, or -1 where
    the assignment is another device's or over capacity; the assignments dropped). Ranks go
    first choices first, then by token (GShard's priority: a token loses its second expert
    before another token loses its first)."""
    n, k = experts_nk.shape
    local = (experts_nk - first).T.reshape(-1)  # choice-major
    mine = (local >= 0) & (local < e_local)
    onehot = ((local[:, None] == jnp.arange(e_local)) & mine[:, None]).astype(jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    keep = mine & (rank < cap)
    slot = jnp.where(keep, local * cap + rank, -1).reshape(k, n).T
    return slot, jnp.sum(mine & ~keep).astype(jnp.float32)


def _batched_ffn(buffer_ecd, gate_up_edcf, down_efd, prepare):
    """The experts' SwiGLU on their [E, C, D] buffers: batched matmuls (`grouped`'s `batched`
    kernel, which keeps the weights as given for the backward)."""
    e, c, d = buffer_ecd.shape
    mm = grouped.matmul("batched", prepare=prepare)
    gate_up = mm(buffer_ecd.reshape(e * c, d), gate_up_edcf, None)  # [E C, 2, F]
    # (its halves indexed: split as `_swiglu` splits them, DeepSeek-V3's preset compiled 0.59
    # GB larger, XLA:CPU holding both halves' input gradients of the [E C, D] buffers at once)
    return mm(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], down_efd, None).reshape(e, c, d)


def _swiglu(gate_up_rcf):
    """silu(gate) * up of the dropless experts' [R, 2, F] (autodiff's, in their dtype:
    `swiglu.py`), the halves split as the dense MLP splits them: the backward's cotangent of
    the pair is one concatenation, where indexing each half gave one zero-padded [R, 2, F]
    copy per half (seed 24 of the planner's property: 2 x 0.94 GB at its peak, its step 42.72
    to 41.31 GB)."""
    gate, up = jnp.split(gate_up_rcf, 2, axis=1)
    return jax.nn.silu(gate[:, 0]) * up[:, 0]


def capacity_ffn(x_nd, gate_up_edcf, down_efd, weights_nk, slot_nk, cap: int,
                 axis: str | None = None, n: int = 1, prepare=None):
    """`grouped_ffn` with each expert's assignments in a fixed [cap, D] buffer (`slots`):
    plain batched matmuls, the same shapes whatever the routing (what a GPU without grouped
    matmul kernels runs well); an assignment without a slot contributes zero.

    With the experts split over `axis` (n devices) the tokens move by two all-to-alls
    (GShard's dispatch): this device's assignments go into a [E, cap, D] buffer by their
    global expert (`slots` over all E, each expert taking at most `cap` of this device's), the
    all-to-all hands each device the rows for its experts from every device ([n, E/n, cap,
    D]), they run there, and the second all-to-all brings the outputs home, where each token
    sums its k. A device holds E x cap rows, about its own assignments x the capacity factor,
    whatever n: where gathering every device's tokens (`grouped_ffn`'s dispatch) holds n
    times them. Without `axis` (n = 1) the experts are all local and nothing moves."""
    k, (e_local, d) = slot_nk.shape[1], gate_up_edcf.shape[:2]
    flat = slot_nk.reshape(-1)
    kept = flat >= 0
    where = jnp.where(kept, flat, n * e_local * cap)  # the assignments without a slot: one more row
    rows = x_nd[jnp.arange(flat.size) // k]  # each assignment's token
    send = jnp.zeros((n * e_local * cap + 1, d), x_nd.dtype).at[where].set(rows)[:-1]

    def exchange(v):  # [n, E/n x cap, D]: the row blocks for device i go to device i
        return jax.lax.all_to_all(v, axis, 0, 0, tiled=True) if axis else v

    got = exchange(send.reshape(n, e_local * cap, d))
    # [source, local expert, cap, D] -> [local expert, source x cap, D]
    got = got.reshape(n, e_local, cap, d).swapaxes(0, 1).reshape(e_local, n * cap, d)
    out = _batched_ffn(got, gate_up_edcf, down_efd, prepare)
    out = out.reshape(e_local, n, cap, d).swapaxes(0, 1).reshape(n, e_local * cap, d)
    back = exchange(out).reshape(-1, d)  # [E x cap, D]
    y = jnp.where(kept[:, None], back[jnp.minimum(where, back.shape[0] - 1)], 0)
    return jnp.einsum("nkd,nk->nd", y.reshape(-1, k, d), weights_nk.astype(y.dtype))


def experts_layer(x_btd, router_de, gate_up_edcf, down_efd, bias_e, probe_s, *,
                  routing: Routing, aux_weight: float, z_weight: float,
                  capacity_factor: float = 0.0, kernel: str = "ragged",
                  weight_grad: str = "xla"):
    """The routed experts of an MoE layer: y[B, T, D] for x[B, T, D] (the weights as used:
    cast, and laid out by the compute rules: experts over `expert`, their hidden dim over
    `tensor`).

    Per device (a shard_map manual over the axes that split tokens and the tensor axis; inside
    a pipeline's, those already manual stay so): each device routes its own tokens. With
    expert parallelism the tokens and their choices are all-gathered over `expert` (one of the
    batch's axes), each device runs its experts on the assignments that chose them, and the
    outputs are reduce-scattered back, each token's sum over the devices holding its experts:
    exact and dropless, one all-gather and one reduce-scatter of the tokens per layer. Under
    tensor parallelism each device holds a slice of every expert's hidden dim; their partial
    outputs are summed over `tensor` last, once per token (Megatron's row-parallel sum): left
    to the compiler, the sum comes before the reduce-scatter and the weighting, over every
    gathered assignment, k x expert times the bytes."""
    # inside a pipeline's shard_map `tensor` stays automatic (`per_device`): the compiler then
    # sums over it before the reduce-scatter, every gathered assignment (docs/moe.md)
    shards = per_device(current_layout(), x_btd, extra="mlp")
    tokens, t_axis = shards.tokens, shards.extra
    e_axis = EXPERT if EXPERT in tokens else None
    how = (aux_weight, z_weight, tokens)

    def local(x, router, gate_up, down, bias, probe):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        router, probe = vary(router, tokens), vary(probe, tokens)
        # fp32 operands, as DeepSeek-V3's gate and Megatron's `moe_router_dtype=fp32`: the
        # logits decide discrete choices, and a bf16 input or weight ties and flips them
        logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), router)
        experts = choose(logits, routing, bias)
        first, mine, e_local = 0, experts, gate_up.shape[0]
        exchange = capacity_factor > 0 and e_axis is not None  # all-to-alls, not a gather
        if e_axis is not None and not exchange:  # every assignment of the group, and ours
            mine = jax.lax.all_gather(experts, e_axis, tiled=True)
            first = jax.lax.axis_index(e_axis) * e_local
        dropped, slot = 0.0, None
        if capacity_factor > 0:  # exchanged: each expert takes `cap` of each device's
            cap = capacity(capacity_factor, mine.size, bias.shape[0])
            slot, dropped = slots(mine, first, bias.shape[0] if exchange else e_local, cap)
        weights = weigh(balanced(logits, probe, experts, dropped, how), experts, routing)
        if t_axis is not None:  # before the gather: the backward sums one token's gradient
            # (and the weights', in fp32: they meet the experts' outputs, which vary over
            # `tensor`, cast to the compute dtype)
            x, weights = vary(x, t_axis), vary(weights, t_axis)
        # the weights varying over the tokens' axes: the grouped matmul makes them so itself,
        # forward and backward, and keeps them as given (`grouped.matmul`'s `prepare`)
        varied = functools.partial(vary, axes=tokens)
        if exchange:
            y = capacity_ffn(x, gate_up, down, weights, slot, cap, e_axis,
                             bias.shape[0] // e_local, varied)
        else:
            if e_axis is not None:
                x, weights = all_gather(x, e_axis), all_gather(weights, e_axis)
            y = (grouped_ffn(x, gate_up, down, weights, mine, first, kernel, weight_grad, varied)
                 if slot is None else
                 capacity_ffn(x, gate_up, down, weights, slot, cap, prepare=varied))
            if e_axis is not None:
                y = psum_scatter(y, e_axis)
        if t_axis is not None:
            y = psum(y, t_axis)
        return y.reshape(b, t, d)

    e = e_axis if e_axis in shards.axes else None  # the experts' weights: entered split
    specs = (shards.spec(None), P(), P(e, None, None, t_axis), P(e, t_axis, None), P(), P())
    return shards(local, specs, shards.spec(None))(x_btd, router_de, gate_up_edcf, down_efd,
                                                    bias_e, probe_s)


def traffic(m, expert: int, tensor: str, tokens: int, c: int, forwards: float, restaged: float,
            backwards: float, recomputes: bool) -> list[tuple[str, str, str, float]]:
    """What MoE layers move in a step, per device, for the planner (`plan.traffic.transfers`):
    (what, kind, mesh axis, bytes), counted as the compiled step's are; read from the HLO of
    Mixtral 8x22B's compiled step and the MoE layouts of `tests/test_estimate.py`. `m`: the
    model config; `expert`: the expert degree; `tensor`: how the layer meets a tensor split,
    "" (none), "manual" (its shard_map sums the experts' outputs over `tensor` itself, and the
    transpose its inputs' gradients, in fp32: `manual.psum`) or "auto" (inside a pipeline it
    keeps `tensor` automatic); `tokens`: a microbatch's on a device; `c`: the compute dtype's
    bytes; the layer passes a device runs: `forwards`, `restaged` (whole-stage recomputes),
    `backwards`; `recomputes`: whether a layer's backward recomputes its forward."""
    f32, out = 4, []
    # the capacity path with the experts split exchanges buffers of `cap` rows an expert
    exchanged = (capacity(m.capacity_factor, tokens * m.experts_per_token, m.num_experts)
                 if m.capacity_factor > 0 and expert > 1 else 0)
    if tensor == "manual":  # the extra bytes of summing a narrow float in fp32
        out.append(("experts' sums, in fp32", "reduce", TENSOR,
                    tokens * m.d_model * (f32 - c) * (forwards + backwards)))
    if tensor == "auto":
        # the compiler reduces the experts' partial sums over every gathered assignment,
        # [R, D] with R = expert x tokens x min(k, local experts), where the MLP's own
        # reduction would be: forward once, backward twice (the inputs' gradients of gate and
        # up) and once more where the backward recomputes the outputs (the router weights'
        # gradient needs them)
        rows = (m.num_experts * exchanged if exchanged else
                expert * tokens * min(m.experts_per_token, m.num_experts // expert))
        out.append(("experts' partial sums", "reduce", TENSOR, rows * m.d_model * c
                    * (forwards + restaged + backwards * (2 + recomputes))))
    if exchanged:
        # each device's E x cap rows to the experts' devices and their outputs back, an
        # all-to-all each way (counted by the operand), again where a recompute redoes them,
        # and the two transposes in the backward
        rows = m.num_experts * exchanged * m.d_model * c
        out += [("tokens to the experts and back", "all-to-all", EXPERT,
                 2 * rows * (forwards + restaged + backwards * recomputes)),
                ("their gradients", "all-to-all", EXPERT, 2 * rows * backwards)]
    elif expert > 1:
        # the tokens all-gathered over `expert` (with their choices: k weights and ids), the
        # outputs reduce-scattered back, the backward the transposes; the reduce-scatters
        # sum a narrow float in fp32 (`manual.psum_scatter`, `manual.all_gather`)
        gathered = expert * tokens * m.d_model * c
        summed = expert * tokens * m.d_model * max(c, f32)
        choices = expert * tokens * m.experts_per_token * (f32 + 4)
        out += [("tokens to the experts", "gather", EXPERT, (gathered + choices)
                 * (forwards + restaged + backwards * recomputes)),
                # (a recompute drops it: the backward needs the experts' outputs, not sums)
                ("experts' outputs back", "reduce-scatter", EXPERT,
                 summed * (forwards + restaged)),
                ("tokens' gradients back", "reduce-scatter", EXPERT,
                 (summed + expert * tokens * m.experts_per_token * f32) * backwards),
                ("outputs' gradients to the experts", "gather", EXPERT, gathered * backwards)]
    return out
