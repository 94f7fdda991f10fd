"""Causal attention kernels, and the one table that picks the kernel for a run.

| kind      | when                                          | what runs                           |
|-----------|-----------------------------------------------|-------------------------------------|
| `blocked` | the whole sequence on each device             | `causal_attention`: pure JAX flash  |
|           |                                               | tiles (the ring's code, ring of 1)  |
| `cudnn`   | the whole sequence; a GPU, bf16/fp16, head    | `fused_attention`: cuDNN flash      |
|           | dim a multiple of 8 and <= 128 (256: Hopper)  | attention (jax.nn)                  |
| `pallas`  | as cudnn, with packed documents; head dim a   | `flash_attention`: jax's Pallas-    |
|           | power of 2 in 16..256, T a multiple of 128    | Triton flash kernel, document ids   |
| `ring`    | T is split over a mesh axis (`seq`)           | zig-zag ring attention (`ring.py`)  |
| `gather`  | T split over `seq`, inside ZB-H1's per-stage  | K/V all-gathered over `seq`, local  |
|           | branches (a ring's permutes there deadlock)   | queries against them (`ring.py`)    |
| `ulysses` | T split over `seq`, the kv heads of a tensor  | two all-to-alls around one of the   |
|           | shard divide by seq (`parallel.context`)      | kernels above (`ulysses.py`)        |

`model.attention` asks for a kernel (auto, blocked, cudnn); with the sequence split over
`seq`, `parallel.context` asks for the ring or Ulysses (auto: Ulysses while the kv heads of a
tensor shard divide by seq, else the ring, as Megatron advises); `choose` turns them into the
kind, once, for the plan (`Plan.attention`, and for Ulysses `Plan.attention_local`, the kernel
it runs on the whole sequence); the step calls `select` with it, and says whether the
code runs inside a shard_map already manual over the ring axis (the pipeline's), where the
per-device ring runs directly. GPU kernels join this table, not the model.

Packed documents (`Plan.eot`) on a GPU take `pallas`. jax 0.10's `jax.nn.dot_product_attention`
takes no document ids: cuDNN gets them as a dense [B, 1, T, T] mask, read per layer and grown
with T^2 (0.5 GiB a row at T = 16k). Of the kernels that take the ids themselves, jax's own
Pallas-Triton `mha` is a flash kernel (blocks above the diagonal skipped, scores never stored)
that needs no new dependency, runs on any CUDA GPU, and runs here too, through Pallas's
interpreter, so the tests check it against the blocked kind. cuDNN's packed layout sits behind
jax's private API, on Hopper only, with offsets in place of ids; Transformer Engine is a large
dependency built against one CUDA. Where `pallas` cannot run, the plan falls back to `cudnn`'s
dense mask and `Plan.describe` says why in one line. It has no GQA: the K/V heads are repeated
to the query heads' count (the repeat's transpose sums their gradients).

Under ring attention the blocks stay pure JAX: the ring merges per-block results by their
log-sum-exp, and `jax.nn.dot_product_attention(..., return_residual=True)` hands cuDNN's fp32
statistics back cast to the output dtype; in bf16 a log-sum-exp near 10 is off by up to 0.04,
so merged weights would be off by up to 4 %.
Shapes: q[B, T, K, G, H], k/v[B, S, K, H] -> out[B, T, K, G, H].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .flash import tile_size
from .manual import per_device
from .ring import TILE, gathered_attention_local, ring_attention, ring_attention_local
from .ring import working as ring_working
from .schema import ConfigError
from .sharding import current_layout
from .ulysses import ulysses_local

KINDS = ("blocked", "cudnn", "pallas", "ring", "gather", "ulysses")
SPLIT = ("ring", "gather", "ulysses")  # the kinds that run with T split over the `seq` axis
RINGS = ("ring", "gather")  # the split kinds that score a device's queries against K/V blocks
# what `fused_attention` asks jax for; the tests set "xla" (JAX's reference of the same call)
# to run the cudnn kind's plumbing -- head layout, sharding, gradients -- on a CPU
FUSED = "cudnn"
# the Pallas kernel runs through Pallas's interpreter where this is True: the tests run its
# plumbing -- document ids, GQA, the per-device map, gradients -- on a CPU
INTERPRET = False


def computed_fraction(t: int, tile: int = TILE) -> float:
    """The share of the full T x T score matrix that `causal_attention` computes: its score
    tiles on and below the diagonal, (n + 1) / 2n of n x n tiles (0.5 is the causal half
    itself; 1 for one tile, which is scored whole and masked)."""
    n = t // tile_size(t, tile)
    return (n + 1) / (2 * n)


def causal_attention(q_btkgh, k_bskh, v_bskh, segments=None, tile: int = TILE):
    """Causal GQA attention in pure JAX, flash style: the ring's per-device code on a ring of
    one (`ring.py`), so score tiles of at most `tile` x `tile` (`flash.py`), an online
    softmax in fp32 forward, the probabilities recomputed per tile from the saved log-sum-exp
    backward, and a custom VJP that keeps q, k, v, the output and the rows' log-sum-exp, never
    the scores: memory linear in T. Tiles above the diagonal are skipped (by position: by
    document would ask the whole batch, a collective per tile). `segments`[B, T]: a
    document id per position; a query sees its own document's keys only."""
    t = q_btkgh.shape[1]
    if t % 2:  # the ring's code halves the sequence: one more position, seen by no query
        q_btkgh, k_bskh, v_bskh, segments = (
            None if x is None else jnp.pad(x, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2))
            for x in (q_btkgh, k_bskh, v_bskh, segments))
    return ring_attention_local(q_btkgh, k_bskh, v_bskh, None, 1, segments, tile)[:, :t]


def cached_attention(q_btkgh, k_bskh, v_bskh, positions_bt, scale: float | None = None):
    """Queries at absolute positions[B, T] over a KV cache k/v[B, S, K, H] whose slot s holds
    position s: a query at p sees the keys at 0..p (the cache's later slots are not written
    yet, or hold padding). For generation; scores and softmax in fp32, scaled by `scale`
    (default H^-1/2; MLA's absorbed queries are wider than the heads they stand for)."""
    s = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    mask = jnp.arange(k_bskh.shape[1]) <= positions_bt[:, None, None, :, None]
    scale = q_btkgh.shape[-1] ** -0.5 if scale is None else scale
    p = jax.nn.softmax(jnp.where(mask, s * scale, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskh->btkgh", p.astype(v_bskh.dtype), v_bskh)


def fused_attention(q_btkgh, k_bskh, v_bskh, implementation: str | None = None,
                    segments=None):
    """Causal GQA attention in one fused kernel: cuDNN flash attention on a GPU (`FUSED`,
    unless `implementation` names another), which never materialises the scores and skips the
    blocks above the diagonal. -> out[B, T, K, G, H]. With `segments`, jax 0.10's call takes
    no document ids: their mask goes in as a dense [B, 1, T, T] boolean (`choose` warns)."""
    b, t, k, g, h = q_btkgh.shape
    mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
    # query head n = k * G + g reads key/value head k: the kernel's GQA grouping
    out = jax.nn.dot_product_attention(q_btkgh.reshape(b, t, k * g, h), k_bskh,
                                       _padded(v_bskh, h), mask=mask, is_causal=True,
                                       implementation=implementation or FUSED)
    return out.reshape(q_btkgh.shape)[..., :v_bskh.shape[-1]]


def _padded(v, h: int):
    """v[..., E] with zeros up to the query head's width h: the fused kernels take one head
    width for q, k and v (MLA's values are narrower); the output's extra columns are zeros."""
    e = v.shape[-1]
    return v if e == h else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, h - e)])


def flash_attention(q_btkgh, k_bskh, v_bskh, segments=None, interpret: bool | None = None):
    """Causal GQA flash attention that takes `segments`[B, T] (document ids) itself: jax's
    Pallas-Triton kernel, per device (`_per_device`); `interpret` (default `INTERPRET`): through
    Pallas's interpreter. -> out[B, T, K, G, H]."""
    return _per_device(lambda q, k, v, ids: _pallas(q, k, v, ids, interpret), q_btkgh, k_bskh,
                       v_bskh, segments)


def _pallas(q, k, v, ids, interpret: bool | None = None):
    """jax's Pallas-Triton `mha` on one device's arrays, its K/V heads repeated to the query
    heads' count (it has no GQA)."""
    from jax.experimental.pallas.ops.gpu.attention import mha

    b, t, kv, g, h = q.shape
    out = mha(q.reshape(b, t, kv * g, h), jnp.repeat(k, g, axis=2),
              jnp.repeat(_padded(v, h), g, axis=2), ids, sm_scale=h ** -0.5, causal=True,
              interpret=INTERPRET if interpret is None else interpret)
    return out.reshape(q.shape)[..., :v.shape[-1]]


def _per_device(kernel, q, k, v, segments):
    """`kernel(q, k, v, segments)` inside a shard_map manual over the mesh axes that split the
    batch and the heads in the current layout: a Pallas call has no partitioning rule, so left
    to XLA every device would gather the whole batch and all heads and run them all. (Pallas's
    jax kernel declares no varying axes for its outputs, so the map does not check them; that
    is also why it does not run nested in a pipeline's shard_map, see `choose`.)"""
    shards = per_device(current_layout(), extra="kv_heads")
    qs, ks = shards.spec(shards.extra, None, None), shards.spec(shards.extra, None)
    return shards(kernel, (qs, ks, ks, shards.spec()), qs, check_vma=False)(q, k, v, segments)


def whole(kind: str, tile: int = TILE):
    """The kernel `(q, k, v, segments) -> out` of `kind` (blocked, cudnn, pallas) over the
    whole sequence on one device: what Ulysses runs on its heads; `tile`: the blocked
    kernel's."""
    return {"blocked": lambda q, k, v, ids: causal_attention(q, k, v, ids, tile),
            "cudnn": lambda q, k, v, ids: fused_attention(q, k, v, segments=ids),
            "pallas": lambda q, k, v, ids: _pallas(q, k, v, ids)}[kind]


def choose(requested: str, *, platform: str, dtype: str, head_dim: int, seq: int,
           hopper: bool = False, branched: bool = False, seq_len: int = 128,
           stage: int = 1, documents: bool = False, context: str = "ring", kv_heads: int = 1,
           tensor: int = 1, across_nodes: bool = False) -> str:
    """The attention kind (see the table) for `model.attention = requested` on `platform`
    with compute `dtype`, `head_dim`, sequences of `seq_len` split over `seq` devices and,
    with `documents`, packed documents; `stage`: the pipeline's stages; `branched`: the layers
    run inside per-device branches (ZB-H1); `context` (`parallel.context`), `kv_heads` (a
    tensor shard's) and `tensor`: ring or Ulysses over `seq` (Ulysses' own kernel: `choose`
    with seq 1; `auto` takes the ring where `seq` spans nodes: `across_nodes`). An explicit
    kernel or context that cannot run raises ConfigError naming its field; `auto` falls back
    (`fallback` says why)."""
    if seq > 1:
        why = _why_not_ulysses(seq=seq, kv_heads=kv_heads, branched=branched, stage=stage,
                               tensor=tensor)
        if context == "ulysses" and why:
            raise ConfigError("parallel.context", f"ulysses {why}; use ring or auto")
        if context == "ulysses" or (context == "auto" and not why and not across_nodes):
            return "ulysses"
    kernels = {name: why(platform=platform, dtype=dtype, head_dim=head_dim, seq=seq,
                         hopper=hopper, seq_len=seq_len, stage=stage)
               for name, why in (("cudnn", _why_not_cudnn), ("pallas", _why_not_pallas))}
    if kernels.get(requested):
        raise ConfigError("model.attention", f"{requested} {kernels[requested]}; use auto "
                          "or blocked")
    if seq > 1:
        return "gather" if branched else "ring"
    if requested != "auto":
        return requested
    if documents and not kernels["pallas"]:
        return "pallas"
    return "cudnn" if not kernels["cudnn"] else "blocked"


def fallback(**shape) -> str:
    """Why packed documents on a GPU do not get `pallas` (choose's arguments), or ""."""
    return _why_not_pallas(**shape) or ""


def _why_not_ulysses(*, seq, kv_heads, branched, stage, tensor):
    return (f"splits a tensor shard's kv heads over seq: its {kv_heads} do not divide by "
            f"mesh.seq = {seq}" if kv_heads % seq else
            "does not run inside ZB-H1's per-stage branches, where XLA:CPU meets each "
            "collective with every device of the program (the ring gathers K/V there)"
            if branched else
            f"inside a pipeline needs mesh.tensor = 1 (it is {tensor}): the per-stage code "
            "keeps tensor automatic, and an all-to-all over seq there gathers the heads over "
            "tensor first" if stage > 1 and tensor > 1 else None)


def _why_not_gpu(*, platform, dtype, **_):
    return (f"needs a GPU (this run's devices are {platform})" if platform != "gpu" else
            f"needs bfloat16 or float16 compute (model.dtype is {dtype})"
            if dtype not in ("bfloat16", "float16") else None)


def _why_not_cudnn(*, head_dim, seq, hopper, **rest):
    limit = 256 if hopper else 128
    return _why_not_gpu(**rest) or (
        f"needs a head dim that is a multiple of 8 and <= {limit} (it is {head_dim})"
        if head_dim % 8 or head_dim > limit else
        f"does not run under ring attention (mesh.seq = {seq}): the blocks' "
        "log-sum-exp comes back in the output dtype, too coarse to merge them"
        if seq > 1 else None)


def _why_not_pallas(*, head_dim, seq, seq_len, stage=1, **rest):
    return _why_not_gpu(**rest) or (
        f"needs a head dim that is a power of 2 from 16 to 256 (it is {head_dim})"
        if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256 else
        f"needs train.seq_len a multiple of 128 (it is {seq_len})" if seq_len % 128 else
        f"runs with the whole sequence on each device (mesh.seq = {seq})" if seq > 1 else
        f"does not run inside a pipeline's per-stage code (mesh.stage = {stage}): its kernel "
        "leaves its outputs untyped for the manual axes there" if stage > 1 else None)


def working(kind: str, *, heads: float, kv_heads: float, head_dim: int, seq_len: int, seq: int,
            itemsize: int, tile: int = TILE, score_bytes: float | None = None) -> float:
    """Bytes per token of one device that kernel `kind`'s backward holds beyond its layer's
    residuals, for the planner: the blocked kernel, the ring and the gather their score tiles
    (`ring.working`, tiles of `tile`; the blocked kernel is the ring's code on a ring of one),
    a fused flash kernel (cudnn, pallas) nothing. `heads`,
    `kv_heads`: on the device; `seq`: the degree that splits the sequence."""
    if kind == "blocked" or kind in SPLIT:
        return ring_working(heads, kv_heads * head_dim, head_dim, seq_len // seq, seq, itemsize,
                            gathered=kind == "gather", tile=tile, score_bytes=score_bytes)
    return 0.0


def select(kind: str, axis: str | None = None, mesh=None, manual: bool = False,
           tile: int = TILE, local: str = "blocked"):
    """The attention function `(q, k, v, segments=None) -> out` of `kind` (see the table
    above); `segments`[B, T]: the positions' document ids (packed documents). `ring` needs the
    ring's mesh `axis` and `mesh` (the context mesh when nested in another shard_map);
    `manual`: the caller is per-device over `axis` already (and its `segments` its own);
    `tile`: the ring's and the gather's score tiles' side at most (`model.attention_tile`);
    `local`: the kernel Ulysses runs on the whole sequence of its heads."""
    if kind == "blocked":
        return lambda q, k, v, segments=None: causal_attention(q, k, v, segments, tile)
    if kind == "cudnn":
        return lambda q, k, v, segments=None: fused_attention(q, k, v, segments=segments)
    if kind == "pallas":
        return lambda q, k, v, segments=None: flash_attention(q, k, v, segments=segments)
    if kind not in SPLIT:
        raise ValueError(f"unknown attention kind {kind!r} (known: {', '.join(KINDS)})")
    if kind == "ulysses":
        n, inner = mesh.shape[axis], whole(local, tile)
        if manual:
            return lambda q, k, v, segments=None: ulysses_local(q, k, v, axis, n, inner, segments)
        return lambda q, k, v, segments=None: _per_device(
            lambda q, k, v, ids: ulysses_local(q, k, v, axis, n, inner, ids), q, k, v, segments)
    if kind == "gather":  # runs in the pipeline's per-device code only (ZB-H1)
        if not manual:
            raise ValueError("gather attention runs inside a shard_map manual over its axis")
        return lambda q, k, v, segments=None: gathered_attention_local(
            q, k, v, axis, mesh.shape[axis], segments, tile)
    if manual:
        n = mesh.shape[axis]
        return lambda q, k, v, segments=None: ring_attention_local(q, k, v, axis, n, segments,
                                                                   tile)
    return lambda q, k, v, segments=None: ring_attention(q, k, v, axis, mesh, segments, tile)
