"""Causal ring attention over a mesh axis (context parallelism), zig-zag balanced.

Per-device view (inside a shard_map manual over the ring axis, n devices): with the sequence in
2n chunks, device i holds chunks i and 2n-1-i (the zig-zag layout), so every device does the
same causal work. Queries stay put; K/V blocks travel around the ring with `ppermute`, and an
online (flash-style) softmax accumulates the output in fp32. At ring step j device i holds the
K/V of device src = (i - j) mod n:
  j = 0:     its own chunks, causally masked;
  src < i:   both query chunks see the first K/V chunk (src) entirely, the second not at all;
  src > i:   the second query chunk (2n-1-i) sees both K/V chunks entirely, the first none;
so after step 0 each step computes exactly half of a block pair and never a masked block.
The backward pass (custom VJP) runs the ring again, with dK/dV travelling alongside K/V so
they arrive home after n shifts.

Inside a step the half-block is itself attended in score tiles of at most `tile` queries by
`tile` keys (`flash.py`), so a step holds a few [rows, heads, tile, tile] tiles, not the
[T, T/2] half-block: memory is linear in the local length.

Packed documents (`segments`[B, T], a document id per position): a query sees only keys of its
own document. The keys' ids travel with K/V; a tile where no query sees any key (other
documents only) is skipped, forward and backward, and a query row that sees nothing in a block
adds nothing to the online softmax (its own key, in step 0, is always visible).
Shapes: q[B, T, K, G, H], k/v[B, T, K, H] with T the local length (two chunks of T/2).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .flash import TILE, Visible, attend, attend_bwd, merge, rows, tile_size
from .manual import unroll, vary, varying

F32 = jnp.float32


def zigzag_order(seq_len: int, n: int) -> np.ndarray:
    """Global position held at each place of the zig-zag layout (device-major)."""
    c = seq_len // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def _halves(x, axis):
    c = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, c, axis=axis), jax.lax.slice_in_dim(x, c, 2 * c, axis=axis)


def _positions(t, i, n):
    """Global positions of a device's own two chunks (zig-zag), for step 0's causal mask."""
    c = t // 2
    return jnp.concatenate([i * c + jnp.arange(c), (2 * n - 1 - i) * c + jnp.arange(c)])


def _own(seg, t, i, n) -> Visible:
    """A device's queries against its own keys (step 0): causal, and within documents; on a
    ring of one (the blocked kernel, outside any shard_map) tiles skipped by position only."""
    pos = _positions(t, i, n)
    return Visible(pos, pos, seg, seg, by_documents=n > 1)


def _early(seg_q, seg_k) -> Visible:
    """src < i: all queries against the first K/V chunk, causally all visible."""
    return Visible(seg_q=seg_q, seg_k=None if seg_k is None else _halves(seg_k, 1)[0])


def _late(seg_q, seg_k) -> Visible:
    """src > i: the second query chunk against all K/V, causally all visible."""
    return Visible(seg_q=None if seg_q is None else _halves(seg_q, 1)[1], seg_k=seg_k)


def _step_update(acc, q, k, v, seg_q, seg_k, src, i, scale, tile):
    """Merge the visible half-block of ring step with K/V from `src` (src != i)."""

    def early(acc):  # src < i: all queries, first K/V chunk
        k1, v1 = _halves(k, 1)[0], _halves(v, 1)[0]
        return merge(acc, attend(q, k1, v1, scale, _early(seg_q, seg_k), tile))

    def late(acc):  # src > i: second query chunk, all K/V
        q2 = _halves(q, 1)[1]
        (o_a, o_b), (m_a, m_b), (l_a, l_b) = _halves(acc[0], 1), _halves(acc[1], 3), _halves(acc[2], 3)
        o_b, m_b, l_b = merge((o_b, m_b, l_b), attend(q2, k, v, scale, _late(seg_q, seg_k),
                                                        tile))
        return (jnp.concatenate([o_a, o_b], 1), jnp.concatenate([m_a, m_b], 3),
                jnp.concatenate([l_a, l_b], 3))

    return jax.lax.switch(jnp.where(src < i, 0, 1), [early, late], acc)


def _sources(kv, axis, n, gather: bool):
    """(the blocks (K, V and the keys' document ids, if any) of the first remote step,
    step(kv, j) -> (the blocks of step j's source, what to carry)): on a ring the blocks
    travel, one `ppermute` per step issued before the compute it overlaps; gathered, every
    device's block is at hand and step j slices source (i - j) mod n out of the sequence's."""
    if not gather:
        shift = [(d, (d + 1) % n) for d in range(n)]
        return jax.lax.ppermute(kv, axis, shift), lambda kv, j: (
            kv, jax.lax.ppermute(kv, axis, shift))
    i, t = jax.lax.axis_index(axis), kv[0].shape[1]
    every = [jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in kv]
    return (), lambda kv, j: (tuple(jax.lax.dynamic_slice_in_dim(x, (i - j) % n * t, t, 1)
                                    for x in every), kv)


def _blocks(k, v, seg):
    return (k, v) if seg is None else (k, v, seg)


def _seg(blocks):
    return blocks[2] if len(blocks) > 2 else None


def _index(axis, n):
    """This device's place on the ring; 0 on a ring of one, which needs no axis."""
    return 0 if n == 1 else jax.lax.axis_index(axis)


def _forward(q, k, v, seg, axis, n, gather=False, tile=TILE):
    i = _index(axis, n)
    scale = q.shape[-1] ** -0.5
    # the first shift in flight meanwhile
    first, step = _sources(_blocks(k, v, seg), axis, n, gather) if n > 1 else (None, None)
    acc = attend(q, k, v, scale, _own(seg, q.shape[1], i, n), tile)

    def body(carry, j):
        acc, kv = carry
        here, kv = step(kv, j)
        acc = _step_update(acc, q, here[0], here[1], seg, _seg(here), (i - j) % n, i, scale,
                           tile)
        return (acc, kv), None

    if n > 1:
        (acc, _), _ = jax.lax.scan(body, (acc, first), jnp.arange(1, n), unroll=unroll())
    o, m, l = acc
    out = (o / rows(l)).astype(q.dtype)
    return out, m + jnp.log(l)  # log-sum-exp per row, for the backward


def _step_grads(q, k, v, do, lse, delta, seg_q, seg_k, src, i, scale, grads, tile):
    """(dq, dk, dv) with the visible half-block of a step with K/V from `src` (src != i)."""

    def early(grads):  # src < i: all queries, first K/V chunk
        dq, dk, dv = grads
        (k1, _), (v1, _) = _halves(k, 1), _halves(v, 1)
        a, b, c = attend_bwd(q, k1, v1, do, lse, delta, scale, _early(seg_q, seg_k), tile)
        (dk1, dk2), (dv1, dv2) = _halves(dk, 1), _halves(dv, 1)
        return dq + a, jnp.concatenate([dk1 + b, dk2], 1), jnp.concatenate([dv1 + c, dv2], 1)

    def late(grads):  # src > i: second query chunk, all K/V
        dq, dk, dv = grads
        (_, q2), (_, do2) = _halves(q, 1), _halves(do, 1)
        (_, lse2), (_, delta2) = _halves(lse, 3), _halves(delta, 3)
        a, b, c = attend_bwd(q2, k, v, do2, lse2, delta2, scale, _late(seg_q, seg_k), tile)
        dq1, dq2 = _halves(dq, 1)
        return jnp.concatenate([dq1, dq2 + a], 1), dk + b, dv + c

    return jax.lax.switch(jnp.where(src < i, 0, 1), [early, late], grads)


def _backward(q, k, v, seg, out, lse, do, axis, n, gather=False, tile=TILE):
    i = _index(axis, n)
    scale = q.shape[-1] ** -0.5
    delta = jnp.moveaxis(jnp.sum(do.astype(F32) * out.astype(F32), axis=-1), 1, 3)  # [B,K,G,T]
    dq, dk, dv = attend_bwd(q, k, v, do, lse, delta, scale, _own(seg, q.shape[1], i, n), tile)
    if n == 1:
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    steps = jnp.arange(1, n)
    if not gather:  # K/V and their gradients move on together: after n shifts dK/dV are home
        shift = [(d, (d + 1) % n) for d in range(n)]

        def body(carry, j):
            dq, (dk, dv, *kv) = carry
            dq, dk, dv = _step_grads(q, *kv[:2], do, lse, delta, seg, _seg(kv), (i - j) % n, i,
                                     scale, (dq, dk, dv), tile)
            return (dq, jax.lax.ppermute((dk, dv, *kv), axis, shift)), None

        travelling = jax.lax.ppermute((dk, dv, *_blocks(k, v, seg)), axis, shift)
        (dq, travelling), _ = jax.lax.scan(body, (dq, travelling), steps, unroll=unroll())
        dk, dv = travelling[:2]
    else:  # the sequence's K/V gathered again, its gradients summed back to their devices
        _, fetch = _sources(_blocks(k, v, seg), axis, n, gather=True)
        t = k.shape[1]
        d_all = [vary(jnp.zeros(x.shape[:1] + (n * t,) + x.shape[2:], F32),
                       varying(jax.typeof(x))) for x in (dk, dv)]

        def body(carry, j):
            dq, d_all = carry
            here, _ = fetch((), j)
            at = (i - j) % n * t
            held = [jax.lax.dynamic_slice_in_dim(a, at, t, 1) for a in d_all]
            dq, dk_j, dv_j = _step_grads(q, *here[:2], do, lse, delta, seg, _seg(here),
                                         (i - j) % n, i, scale, (dq, *held), tile)
            d_all = [jax.lax.dynamic_update_slice_in_dim(a, g, at, 1)
                     for a, g in zip(d_all, (dk_j, dv_j))]
            return (dq, d_all), None

        (dq, d_all), _ = jax.lax.scan(body, (dq, d_all), steps, unroll=unroll())
        dk, dv = (own + jax.lax.psum_scatter(a, axis, scatter_dimension=1, tiled=True)
                  for own, a in zip((dk, dv), d_all))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def gathered_attention_local(q, k, v, axis: str, n: int, segments=None, tile: int = TILE):
    """Per-device causal attention of the local queries (two zig-zag chunks) against the whole
    sequence's K/V, gathered over `axis` (n devices): all-gather context parallelism, as
    LLaMA 3 was trained. Every collective is a gather over the seq group (and, in the backward,
    the gather again and a reduce-scatter of dK/dV), never a permute: it can run inside a
    per-stage branch (ZB-H1's), where XLA:CPU rendezvouses a collective-permute with every
    device of the program, so a ring there deadlocks. The blocks are the ring's, in its order
    and with its online softmax: each step scores the visible half-block of one device's K/V,
    never a masked one, in tiles of at most `tile` x `tile`."""
    return _local(q, k, v, segments, axis, n, True, tile)


def ring_attention_local(q, k, v, axis: str, n: int, segments=None, tile: int = TILE):
    """Per-device causal ring attention, for code already inside a shard_map manual over
    `axis` (n devices), e.g. the pipeline's; `segments`: the local positions' document ids;
    `tile`: the score tiles' queries and keys at most."""
    return _local(q, k, v, segments, axis, n, False, tile)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _local(q, k, v, seg, axis, n, gather, tile):
    return _forward(q, k, v, seg, axis, n, gather, tile)[0]


def _local_fwd(q, k, v, seg, axis, n, gather, tile):
    out, lse = _forward(q, k, v, seg, axis, n, gather, tile)
    return out, (q, k, v, seg, out, lse)


def _local_bwd(axis, n, gather, tile, res, do):
    return (*_backward(*res, do, axis, n, gather, tile), None)


_local.defvjp(_local_fwd, _local_bwd)


def ring_attention(q, k, v, axis: str, mesh, segments=None, tile: int = TILE):
    """Causal ring attention on global arrays whose T dim (in zig-zag order, see
    `zigzag_order`) is split over mesh axis `axis`; other axes (heads over tensor, batch over
    data) pass through automatically; `segments`[B, T]: document ids, in the same order. The
    custom VJP wraps the two shard_maps from outside, so the residuals are plain global arrays
    with explicit layouts (nested inside another shard_map, implicit residual layouts would
    mix the outer and inner manual axes)."""
    n = mesh.shape[axis]
    seq, row = P(None, axis), P(None, None, None, axis)  # [B, T, ...] and lse[B, K, G, T]
    ids = segments  # None goes through the maps as no array at all (its spec covers nothing)
    fwd_map = jax.shard_map(lambda q, k, v, ids: _forward(q, k, v, ids, axis, n, False, tile),
                            mesh=mesh,
                            in_specs=(seq,) * 4, out_specs=(seq, row), axis_names={axis})
    bwd_map = jax.shard_map(
        lambda q, k, v, ids, out, lse, do: _backward(q, k, v, ids, out, lse, do, axis, n, False,
                                                     tile),
        mesh=mesh, in_specs=(seq,) * 5 + (row, seq), out_specs=(seq,) * 3, axis_names={axis})

    @jax.custom_vjp
    def attend(q, k, v, ids):
        return fwd_map(q, k, v, ids)[0]

    def attend_fwd(q, k, v, ids):
        out, lse = fwd_map(q, k, v, ids)
        return out, (q, k, v, ids, out, lse)

    def attend_bwd(res, do):
        q, k, v, ids, out, lse = res
        return (*bwd_map(q, k, v, ids, out, lse, do), None)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, ids)


def working(heads: float, kv: float, head_dim: int, local: int, ring: int, itemsize: int,
            gathered: bool, tile: int = TILE, score_bytes: float | None = None) -> float:
    """Bytes per local token that this module's kernels hold in a layer's backward beyond the
    layer's residuals, for the planner (`plan.memory`): one score tile at a time (the largest
    is step 0's, `tile` x `tile` or the local length) with its fp32 probabilities and gradient
    and the copy a matmul reads; tiled, a key tile's pieces of dQ, stacked in fp32; gathered
    (ZB-H1's kernel), the sequence's K and V with their fp32 gradients. `heads`: query heads
    on the device, `kv`: its kv heads x head dim, `local`: its tokens of a sequence;
    `score_bytes`: a score's bytes as a compiler holds them, if not this count's."""
    side = tile_size(local, tile)
    held = heads * side * side / local * (score_bytes or 2 * 4 + itemsize)
    if side < local:
        held += heads * head_dim * 4
    if gathered:
        held += 2 * ring * kv * (itemsize + 4)
    return held


def traffic(ring: int, gathered: bool, kv: float, kv_grads: float, forwards: float,
            restaged: float, redone: float, backwards: float,
            inlined: bool) -> list[tuple[str, str, float]]:
    """What this module's kernels move over `seq` in a step, per device, for the planner
    (`plan.traffic.transfers`): (what, kind, bytes), counted as the compiled step's are (a
    permute by the bytes it moves, a gather by those it gathers, a reduce-scatter by those it
    reduces). `ring`: the seq degree; `gathered`: ZB-H1's kernel, which gathers the sequence's
    K and V, not the ring; `kv`: one layer pass's K (or V) block on a device, in the compute
    dtype, `kv_grads` its gradient's bytes in fp32; the layer passes a device runs: `forwards`,
    `restaged` (whole-stage recomputes), `redone` (forwards a recompute redoes), `backwards`;
    `inlined`: a loop of one trip is inlined, its unread last shifts dropped (a ring of 2)."""
    if ring == 1:
        return []
    if gathered:  # the whole sequence's K and V gathered again in the backward (a layer's
        # recompute reuses that gather, a stage's does not), their fp32 gradients
        # reduce-scattered
        return [("K, V gathered", "gather", 2 * ring * kv * (forwards + restaged + backwards)),
                ("dK, dV reduce-scattered", "reduce-scatter", 2 * ring * kv_grads * backwards)]
    # K and V shift n times in the forward, n - 1 more in a recompute (its first shift is the
    # backward's), and K, V with their fp32 gradients n times in the backward
    two = ring == 2 and inlined  # one-step loops: their last shifts of K and V dropped
    shifts = (1 if two else ring) * forwards + (0 if two else ring - 1) * redone
    return [("ring K, V", "permute", 2 * kv * (shifts + (ring - two) * backwards)),
            ("ring dK, dV", "permute", 2 * kv_grads * ring * backwards)]
