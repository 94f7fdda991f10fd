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
they arrive home after n shifts; memory is O(local block), not O(sequence).

Packed documents (`segments`[B, T], a document id per position): a query sees only keys of its
own document. The keys' ids travel with K/V; a half-block where no query sees any key (all
other documents) is skipped, forward and backward, and a query row that sees nothing in a block
adds nothing to the online softmax (its own key, in step 0, is always visible).
Shapes: q[B, T, K, G, H], k/v[B, T, K, H] with T the local length (two chunks of T/2).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .manual import unroll, vary, varying

F32 = jnp.float32


def zigzag_order(seq_len: int, n: int) -> np.ndarray:
    """Global position held at each place of the zig-zag layout (device-major)."""
    c = seq_len // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def _scores(q, k, scale):
    return jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=F32) * scale


def _same(seg_q, seg_k):
    """[B, 1, 1, T, S]: whether query t and key s are of one document; None without ids."""
    if seg_q is None:
        return None
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None, None]


def _both(a, b):
    return b if a is None else a if b is None else a & b


def _block_fwd(q, k, v, scale, mask=None):
    """Unnormalized block output and its row statistics: (o[B,T,K,G,H], m, l[B,K,G,T]); a row
    with nothing visible has m = -inf, l = 0 and o = 0."""
    s = _scores(q, k, scale)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=F32)
    return o, m, jnp.sum(p, axis=-1)


def _rows(x_bkgt):  # [B, K, G, T] -> [B, T, K, G, 1] to scale outputs row-wise
    return jnp.moveaxis(x_bkgt, 3, 1)[..., None]


def _merge(acc, new):
    (o1, m1, l1), (o2, m2, l2) = acc, new
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * _rows(a1) + o2 * _rows(a2), m, l1 * a1 + l2 * a2


def _halves(x, axis):
    c = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, c, axis=axis), jax.lax.slice_in_dim(x, c, 2 * c, axis=axis)


def _local_mask(t, i, n):
    """Causal mask of a device's own two chunks against themselves (step 0)."""
    c = t // 2
    pos = jnp.concatenate([i * c + jnp.arange(c), (2 * n - 1 - i) * c + jnp.arange(c)])
    return pos[:, None] >= pos[None, :]


def _visible(seg_q, seg_k, src, i):
    """(the early half-block's mask, the late one's, which of early/late/none to compute):
    src < i: all queries against the first K/V chunk; src > i: the second query chunk against
    all K/V; a half-block where no query sees a key (other documents only) is skipped."""
    if seg_q is None:
        return None, None, jnp.where(src < i, 0, 1)
    early = _same(seg_q, _halves(seg_k, 1)[0])
    late = _same(_halves(seg_q, 1)[1], seg_k)
    branch = jnp.where(src < i, 0, 1)
    return early, late, jnp.where(jnp.any(jnp.where(src < i, jnp.any(early), jnp.any(late))),
                                  branch, 2)


def _step_update(acc, q, k, v, seg_q, seg_k, src, i, scale):
    """Merge the visible half-block of ring step with K/V from `src` (src != i)."""
    mask_early, mask_late, branch = _visible(seg_q, seg_k, src, i)

    def early(acc):  # src < i: all queries, first K/V chunk
        k1, v1 = _halves(k, 1)[0], _halves(v, 1)[0]
        return _merge(acc, _block_fwd(q, k1, v1, scale, mask_early))

    def late(acc):  # src > i: second query chunk, all K/V
        q2 = _halves(q, 1)[1]
        (o_a, o_b), (m_a, m_b), (l_a, l_b) = _halves(acc[0], 1), _halves(acc[1], 3), _halves(acc[2], 3)
        o_b, m_b, l_b = _merge((o_b, m_b, l_b), _block_fwd(q2, k, v, scale, mask_late))
        return (jnp.concatenate([o_a, o_b], 1), jnp.concatenate([m_a, m_b], 3),
                jnp.concatenate([l_a, l_b], 3))

    return jax.lax.switch(branch, [early, late, lambda acc: acc][:3 if seg_q is not None else 2],
                          acc)


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


def _forward(q, k, v, seg, axis, n, gather=False):
    i = jax.lax.axis_index(axis)
    scale = q.shape[-1] ** -0.5
    # the first shift in flight meanwhile
    first, step = _sources(_blocks(k, v, seg), axis, n, gather)
    acc = _block_fwd(q, k, v, scale, _both(_local_mask(q.shape[1], i, n), _same(seg, seg)))

    def body(carry, j):
        acc, kv = carry
        here, kv = step(kv, j)
        acc = _step_update(acc, q, here[0], here[1], seg, _seg(here), (i - j) % n, i, scale)
        return (acc, kv), None

    if n > 1:
        (acc, _), _ = jax.lax.scan(body, (acc, first), jnp.arange(1, n), unroll=unroll())
    o, m, l = acc
    out = (o / _rows(l)).astype(q.dtype)
    return out, m + jnp.log(l)  # log-sum-exp per row, for the backward


def _block_bwd(q, k, v, do, lse, delta, scale, mask=None):
    """(dq, dk, dv) of one block, recomputing probabilities from the saved log-sum-exp."""
    s = _scores(q, k, scale)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("btkgh,bskh->bkgts", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgts,bskh->btkgh", ds.astype(k.dtype), k, preferred_element_type=F32)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds.astype(q.dtype), q, preferred_element_type=F32)
    return dq, dk, dv


def _step_grads(q, k, v, do, lse, delta, seg_q, seg_k, src, i, scale, grads):
    """(dq, dk, dv) with the visible half-block of a step with K/V from `src` (src != i)."""
    mask_early, mask_late, branch = _visible(seg_q, seg_k, src, i)

    def early(grads):  # src < i: all queries, first K/V chunk
        dq, dk, dv = grads
        (k1, _), (v1, _) = _halves(k, 1), _halves(v, 1)
        a, b, c = _block_bwd(q, k1, v1, do, lse, delta, scale, mask_early)
        (dk1, dk2), (dv1, dv2) = _halves(dk, 1), _halves(dv, 1)
        return dq + a, jnp.concatenate([dk1 + b, dk2], 1), jnp.concatenate([dv1 + c, dv2], 1)

    def late(grads):  # src > i: second query chunk, all K/V
        dq, dk, dv = grads
        (_, q2), (_, do2) = _halves(q, 1), _halves(do, 1)
        (_, lse2), (_, delta2) = _halves(lse, 3), _halves(delta, 3)
        a, b, c = _block_bwd(q2, k, v, do2, lse2, delta2, scale, mask_late)
        dq1, dq2 = _halves(dq, 1)
        return jnp.concatenate([dq1, dq2 + a], 1), dk + b, dv + c

    return jax.lax.switch(branch, [early, late, lambda g: g][:3 if seg_q is not None else 2],
                          grads)


def _backward(q, k, v, seg, out, lse, do, axis, n, gather=False):
    i = jax.lax.axis_index(axis)
    scale = q.shape[-1] ** -0.5
    delta = jnp.moveaxis(jnp.sum(do.astype(F32) * out.astype(F32), axis=-1), 1, 3)  # [B,K,G,T]
    dq, dk, dv = _block_bwd(q, k, v, do, lse, delta, scale,
                            _both(_local_mask(q.shape[1], i, n), _same(seg, seg)))
    if n == 1:
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    steps = jnp.arange(1, n)
    if not gather:  # K/V and their gradients move on together: after n shifts dK/dV are home
        shift = [(d, (d + 1) % n) for d in range(n)]

        def body(carry, j):
            dq, (dk, dv, *kv) = carry
            dq, dk, dv = _step_grads(q, *kv[:2], do, lse, delta, seg, _seg(kv), (i - j) % n, i,
                                     scale, (dq, dk, dv))
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
                                         (i - j) % n, i, scale, (dq, *held))
            d_all = [jax.lax.dynamic_update_slice_in_dim(a, g, at, 1)
                     for a, g in zip(d_all, (dk_j, dv_j))]
            return (dq, d_all), None

        (dq, d_all), _ = jax.lax.scan(body, (dq, d_all), steps, unroll=unroll())
        dk, dv = (own + jax.lax.psum_scatter(a, axis, scatter_dimension=1, tiled=True)
                  for own, a in zip((dk, dv), d_all))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def gathered_attention_local(q, k, v, axis: str, n: int, segments=None):
    """Per-device causal attention of the local queries (two zig-zag chunks) against the whole
    sequence's K/V, gathered over `axis` (n devices): all-gather context parallelism, as
    LLaMA 3 was trained. Every collective is a gather over the seq group (and, in the backward,
    the gather again and a reduce-scatter of dK/dV), never a permute: it can run inside a
    per-stage branch (ZB-H1's), where XLA:CPU rendezvouses a collective-permute with every
    device of the program, so a ring there deadlocks. The blocks are the ring's, in its order
    and with its online softmax: each step scores the visible half-block of one device's K/V,
    never a masked one, and keeps [T_local, T/n] scores at a time, not [T_local, T]."""
    return _local(q, k, v, segments, axis, n, True)


def ring_attention_local(q, k, v, axis: str, n: int, segments=None):
    """Per-device causal ring attention, for code already inside a shard_map manual over
    `axis` (n devices), e.g. the pipeline's; `segments`: the local positions' document ids."""
    return _local(q, k, v, segments, axis, n, False)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _local(q, k, v, seg, axis, n, gather):
    return _forward(q, k, v, seg, axis, n, gather)[0]


def _local_fwd(q, k, v, seg, axis, n, gather):
    out, lse = _forward(q, k, v, seg, axis, n, gather)
    return out, (q, k, v, seg, out, lse)


def _local_bwd(axis, n, gather, res, do):
    return (*_backward(*res, do, axis, n, gather), None)


_local.defvjp(_local_fwd, _local_bwd)


def ring_attention(q, k, v, axis: str, mesh, segments=None):
    """Causal ring attention on global arrays whose T dim (in zig-zag order, see
    `zigzag_order`) is split over mesh axis `axis`; other axes (heads over tensor, batch over
    data) pass through automatically; `segments`[B, T]: document ids, in the same order. The
    custom VJP wraps the two shard_maps from outside, so the residuals are plain global arrays
    with explicit layouts (nested inside another shard_map, implicit residual layouts would
    mix the outer and inner manual axes)."""
    n = mesh.shape[axis]
    seq, row = P(None, axis), P(None, None, None, axis)  # [B, T, ...] and lse[B, K, G, T]
    ids = segments  # None goes through the maps as no array at all (its spec covers nothing)
    fwd_map = jax.shard_map(lambda q, k, v, ids: _forward(q, k, v, ids, axis, n), mesh=mesh,
                            in_specs=(seq,) * 4, out_specs=(seq, row), axis_names={axis})
    bwd_map = jax.shard_map(
        lambda q, k, v, ids, out, lse, do: _backward(q, k, v, ids, out, lse, do, axis, n),
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


def traffic(ring: int, gathered: bool, kv: float, kv_grads: float, forwards: float,
            restaged: float, redone: float, backwards: float,
            inlined: bool) -> list[tuple[str, str, float]]:
    """What this module's kernels move over `seq` in a step, per device, for the planner
    (`plan.estimate.transfers`): (what, kind, bytes), counted as the compiled step's are (a
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
