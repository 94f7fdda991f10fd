"""Causal attention kernels, and the one table that picks the kernel for a run.

| kind      | when                                   | what runs                                      |
|-----------|----------------------------------------|------------------------------------------------|
| `blocked` | each device holds the whole sequence   | `causal_attention`: block-causal, fp32 softmax |
| `ring`    | T is split over a mesh axis (`seq`)    | zig-zag ring attention (`ring.py`)             |

The plan names the kind (`Plan.attention`); the step calls `select` with it, and says whether
the code runs inside a shard_map already manual over the ring axis (the pipeline's), where the
per-device ring runs directly. GPU kernels join this table, not the model.
Shapes: q[B, T, K, G, H], k/v[B, S, K, H] -> out[B, T, K, G, H].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .ring import ring_attention, ring_attention_local

KINDS = ("blocked", "ring")


def causal_attention(q_btkgh, k_bskh, v_bskh, block: int = 64):
    """Causal GQA attention; scores and softmax in fp32. -> out[B, T, K, G, H].

    Query block i only looks at key blocks 0..i: the blocks above the diagonal, entirely
    masked, are never computed (about half the score FLOPs and memory at long T). Each query
    block's softmax runs over its whole key prefix, so the result equals dense attention.
    """
    t = q_btkgh.shape[1]
    block = max(block, t // 8)  # at most 8 query blocks: compile time grows with the count
    n = t // block if t % block == 0 and t > block else 1
    size, scale = t // n, q_btkgh.shape[-1] ** -0.5
    # a key block's gradient sums over the query blocks that read it; slicing fp32 copies
    # makes that sum fp32 (in bf16, XLA:CPU converts to fp32 and back around every add)
    dtype = k_bskh.dtype
    k_all, v_all = (k_bskh, v_bskh) if n == 1 else (k_bskh.astype(jnp.float32),
                                                     v_bskh.astype(jnp.float32))
    outs = []
    # a split, not slices: its transpose is one concatenate, not pads and adds
    for i, q in enumerate(jnp.split(q_btkgh, n, axis=1)):
        k = k_all[:, : (i + 1) * size].astype(dtype)
        v = v_all[:, : (i + 1) * size].astype(dtype)
        s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
        mask = jnp.arange(size)[:, None] + i * size >= jnp.arange((i + 1) * size)[None, :]
        p = jax.nn.softmax(jnp.where(mask, s * scale, -jnp.inf), axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkgts,bskh->btkgh", p, v))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=1)


def cached_attention(q_btkgh, k_bskh, v_bskh, positions_bt):
    """Queries at absolute positions[B, T] over a KV cache k/v[B, S, K, H] whose slot s holds
    position s: a query at p sees the keys at 0..p (the cache's later slots are not written
    yet, or hold padding). For generation; scores and softmax in fp32."""
    s = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    mask = jnp.arange(k_bskh.shape[1]) <= positions_bt[:, None, None, :, None]
    p = jax.nn.softmax(jnp.where(mask, s * q_btkgh.shape[-1] ** -0.5, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskh->btkgh", p.astype(v_bskh.dtype), v_bskh)


def select(kind: str, axis: str | None = None, mesh=None, manual: bool = False):
    """The attention function `(q, k, v) -> out` of `kind` (see the table above). `ring` needs
    the ring's mesh `axis` and `mesh` (the context mesh when nested in another shard_map);
    `manual`: the caller is per-device over `axis` already."""
    if kind == "blocked":
        return causal_attention
    if kind != "ring":
        raise ValueError(f"unknown attention kind {kind!r} (known: {', '.join(KINDS)})")
    if manual:
        n = mesh.shape[axis]
        return lambda q, k, v: ring_attention_local(q, k, v, axis, n)
    return lambda q, k, v: ring_attention(q, k, v, axis, mesh)
