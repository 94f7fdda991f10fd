"""The vocabulary's two ends, possibly split over a mesh axis: the embedding lookup and the
head's logits, and how many pieces the loss cuts a device's tokens into.

Per-device view where it must be: the lookup is a shard_map manual over the vocab axis and the
batch's (a plain gather on a vocab-sharded table would make XLA replicate the table).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .mesh import REPLICATE, STAGE
from .manual import per_device, psum, vary
from .sharding import current_layout, mesh_axes


@jax.custom_vjp
def head_logits(x_nd, w_dv):
    """x[N, D] @ w[D, V] -> fp32 logits, and a backward whose two matmuls run in the operands'
    dtype (fp32 accumulation), the fp32 cotangent cast down first, as Megatron does. Autodiff
    would contract the fp32 cotangent with the bf16 operands: XLA then upcasts the [D, V]
    weights for every loss piece and runs both matmuls in fp32 (TF32 on a GPU; measured in
    docs/benchmarks.md). With fp32 compute (the tests) it is autodiff's computation exactly."""
    return jnp.einsum("nd,dv->nv", x_nd, w_dv, preferred_element_type=jnp.float32)


def _head_logits_fwd(x_nd, w_dv):
    return head_logits(x_nd, w_dv), (x_nd, w_dv)


def _head_logits_bwd(residuals, g_nv):
    x_nd, w_dv = residuals
    g = g_nv.astype(w_dv.dtype)
    dx = jnp.einsum("nv,dv->nd", g, w_dv, preferred_element_type=jnp.float32)
    dw = jnp.einsum("nd,nv->dv", x_nd, g, preferred_element_type=jnp.float32)
    return dx.astype(x_nd.dtype), dw.astype(w_dv.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


@jax.custom_vjp
def backward_after(total):
    """The loss pieces' sum, unchanged, whose backward starts only once the forward has it.

    The backward recomputes the pieces in a loop of its own that needs nothing of the forward
    loop, and XLA gives the all-reduces inside both loops (the log-sum-exp over `vocab`) the
    same channel. XLA:CPU (jax 0.10) may then start either loop first on each device: devices
    pair their loops up the other way round, one goes on to the head gradient's all-reduce
    over `data` while its partner still has a loop to run, and the two wait for each other
    until XLA stops the run (docs/benchmarks.md). A GPU keeps one order on every device; tying
    the backward's cotangent to the forward's sum gives that order here too."""
    return total


def _backward_after_bwd(total, g):
    # a data dependency: XLA:CPU's executor orders operations by the buffers they read and
    # write, not by control edges (an optimization barrier becomes one); x - x is not folded
    # for floats (it is NaN for an infinite x), so g is unchanged for any finite loss
    return (g + (total - total),)


backward_after.defvjp(lambda total: (total, total), _backward_after_bwd)


def loss_chunks(tokens: int, chunk: int) -> int:
    """How many pieces the head and loss cut a device's `tokens` into: the fewest that divide
    them evenly with at most `chunk` tokens each (0: one piece)."""
    if chunk <= 0 or tokens <= chunk:
        return 1
    return next(n for n in range(1, tokens + 1) if tokens % n == 0 and tokens // n <= chunk)


def loss_working(tokens: int, chunk: int, d_model: int, vocab_shard: int, head: int,
                 itemsize: int, head_copy: int = 0) -> int:
    """Bytes the loss holds at its widest on a device of `tokens` tokens, for the planner
    (`plan.accumulation.loss_phase`): over several pieces the head's gradient they sum in the
    compute dtype (`itemsize`; `head` elements), an fp32 copy of the head the matmuls read
    (`head_copy` elements), and the larger of a piece's forward (its fp32 logits, their
    rounding and the loss's product with the labels, beside the hidden states) and its
    backward (the logits again, with the softmax and cotangent made in their place, the
    piece's head gradient in fp32 as its matmul gives it, the hidden states and their
    cotangent)."""
    pieces = loss_chunks(tokens, chunk)
    logits, hidden = tokens // pieces * vocab_shard * 4, tokens * d_model * itemsize
    return ((pieces > 1) * head * itemsize + head_copy * 4
            + max(3 * logits + hidden, logits + head * 4 + 2 * hidden))


def traffic(d_model: int, tokens: int, head_tokens: int, table_bytes: int, c: int,
            sequence_parallel: bool) -> list[tuple[str, str, float]]:
    """What the vocabulary's two ends move over `tensor` in a step, per device, for the
    planner (`plan.traffic.transfers`): (what, kind, bytes). The lookup's psum of its vocab
    shards (in fp32 at least: `manual.psum`) over the step's `tokens` on a device, the head's
    input gradient (fp32) over the tokens the head runs on (`head_tokens`: a schedule that
    runs the head in each steady tick counts its runs); under SP (`sequence_parallel`) the
    final norm's output (compute dtype: `c` bytes) and the lookup's cotangent (fp32)
    gathered. `table_bytes`: bytes of one element of the table as stored."""
    out = [("embedding lookup", "reduce", tokens * d_model * max(table_bytes, 4)),
           ("head input gradient", "reduce", head_tokens * d_model * 4)]
    if sequence_parallel:
        out += [("final norm gathered", "gather", head_tokens * d_model * c),
                ("embedding cotangent gathered", "gather", tokens * d_model * 4)]
    return out


def embed_lookup(table_vd, ids_bt):
    """table[V, D][ids] with the vocab dim possibly split over a mesh axis.

    A plain gather on a vocab-sharded table makes XLA replicate the table (and all-gather the
    gradient); instead each shard looks up the ids it owns, zeros the rest, and one psum over
    the vocab axis combines them. Manual over the batch and length axes as well: the
    gradient is then a scatter-add of each device's own rows and one sum of the table's
    gradient over them (left to XLA, it gathers every device's [B, T, D] cotangent first).

    Under HSDP without a vocab split, XLA has no efficient path from cotangents split over
    `replicate` x `data` to a gradient sharded over a ZeRO group's `data` (it replicated them
    whole), so the lookup is manual: where ZeRO shards the gradient's `embed`, each device
    looks up its group's ids in its slice of D and an all-to-all hands every device its own
    rows whole (`_lookup_slices`): the backward's scatter-add makes [V, D/group], not a whole
    fp32 [V, D] per device. So too where a pipeline's stages split the table by D.
    """
    layout = current_layout()
    shards = per_device(layout, ids_bt, extra="vocab")  # (inside a pipeline: its head's MTP)
    axis = shards.extra[0] if shards.extra else None
    split = () if layout is None else tuple(a for a in mesh_axes(layout.grads["embed"])
                                            if a in shards.tokens)
    # (in slices as well: the table a pipeline's stages split by D, `zero_rules(over_stage)`)
    slices = axis is None and split and (REPLICATE in shards.tokens or STAGE in split)
    if axis is None and not slices and REPLICATE not in shards.tokens:
        return jnp.take(table_vd, ids_bt, axis=0)
    if slices:
        return shards(functools.partial(_lookup_slices, split=split, tokens=shards.tokens),
                      (P(None, split), shards.spec()), shards.spec(None))(table_vd, ids_bt)

    def lookup(table, ids):
        table = vary(table, shards.tokens)  # its gradient summed over the token shards (fp32)
        if axis is None:
            return jnp.take(table, ids, axis=0)
        v = table.shape[0]
        local = ids - jax.lax.axis_index(axis) * v
        mine = ((local >= 0) & (local < v)).astype(table.dtype)[..., None]
        # a product with a [B, T, 1] mask: the backward keeps that and the ids, no [B, T, D]
        rows = jnp.take(table, jnp.clip(local, 0, v - 1), axis=0) * mine
        return psum(rows, axis)

    return shards(lookup, (P(axis, None), shards.spec()), shards.spec(None))(table_vd, ids_bt)


def _lookup_slices(table, ids, split: tuple, tokens: tuple):
    """Per device: table[V, D/z] (the slice of D that `split`, z devices, gives it), ids[b, t]
    -> its rows [b, t, D]: the z devices' ids gathered, each looks all of them up in its slice,
    and an all-to-all returns each device's rows with their D whole."""
    table = vary(table, tuple(a for a in tokens if a not in split))  # summed over the rest
    every = jax.lax.all_gather(ids, split, axis=0, tiled=True)  # [b z, t]
    rows = jnp.take(table, every, axis=0)  # [b z, t, D/z]
    return jax.lax.all_to_all(rows, split, 0, 2, tiled=True)  # [b, t, D]
