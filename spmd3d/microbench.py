"""One kernel of a config timed on its own, as a device of its layout runs it (`bench
--attention`, `bench --experts`): the fused attention against the blocked one, and an MoE
layer's grouped matmul against a dense matmul of the same FLOPs."""

from __future__ import annotations

import statistics
import time

from .config import Config, ConfigError


def measure_attention(cfg: Config, repeats: int = 5) -> dict:
    """The fused kernel (`attention.fused_attention`: cuDNN on a GPU, JAX's reference of the
    same call elsewhere) against the blocked one on one layer's attention of `cfg` as a device
    runs it: max |difference| of the output and of dq, dk, dv over the blocked kernel's max
    |value|, and the median seconds of a forward + backward of each; the same again with
    packed documents (about 4 a window: the fused kernel then takes a dense T x T mask), and
    for them the Pallas kernel that takes their ids (`attention.flash_attention`, through
    Pallas's interpreter off a GPU; None where its head dim is not a power of 2)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import attention
    from .plan import Plan

    plan = Plan.resolve(cfg)
    m, t = plan.cfg.model, plan.cfg.train
    rows = max(1, plan.rows_per_microbatch)
    k, g = m.num_kv_heads // plan.degrees.tensor, m.num_heads // m.num_kv_heads
    shapes = [(rows, t.seq_len, k, g, m.dim_per_head)] + [(rows, t.seq_len, k, m.dim_per_head)] * 2
    keys = jax.random.split(jax.random.key(0), 4)
    q, kk, v = (jax.random.normal(key, s, m.dtype) for key, s in zip(keys, shapes))
    ct = jax.random.normal(keys[3], shapes[0], m.dtype)
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"

    rng = np.random.default_rng(0)
    ends = rng.random((rows, t.seq_len)) < 4 / t.seq_len  # about 4 documents a window
    segments = jnp.asarray(np.cumsum(ends, axis=1), jnp.int32)

    def run(kernel):
        def loss(q, kk, v):
            out = kernel(q, kk, v)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        result = jax.block_until_ready(step(q, kk, v))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(q, kk, v))
            times.append(time.perf_counter() - start)
        grads, out = result
        return [out, *grads], statistics.median(times)

    fused, fused_s = run(lambda *a: attention.fused_attention(*a, implementation=implementation))
    blocked, blocked_s = run(attention.causal_attention)
    packed_fused, packed_fused_s = run(lambda *a: attention.fused_attention(
        *a, implementation=implementation, segments=segments))
    packed, packed_s = run(lambda *a: attention.causal_attention(*a, segments=segments))
    flash, flash_s = (run(lambda *a: attention.flash_attention(
        *a, segments=segments, interpret=implementation != "cudnn"))
        if m.dim_per_head & (m.dim_per_head - 1) == 0 else (None, None))

    def error(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    names = ("out", "dq", "dk", "dv")
    return {"implementation": implementation, "dtype": m.dtype,
            "shape": {"rows": rows, "T": t.seq_len, "kv_heads": k, "groups": g,
                      "head_dim": m.dim_per_head},
            "error": {n: error(a, b) for n, a, b in zip(names, fused, blocked)},
            "fused_s": fused_s, "blocked_s": blocked_s,
            "documents": {"error": {n: error(a, b) for n, a, b in zip(names, packed_fused,
                                                                       packed)},
                          "fused_s": packed_fused_s, "blocked_s": packed_s, "pallas_s": flash_s,
                          "pallas_error": flash and {n: error(a, b) for n, a, b in zip(
                              names, flash, packed)}}}


def measure_experts(cfg: Config, repeats: int = 5) -> dict:
    """One MoE layer's grouped matmul as a device runs it -- its (gathered) tokens x min(k,
    local experts) rows, spread evenly over its local experts, times their gate weights --
    through the plan's kernel (`grouped.py`; the capacity path's batched matmul), forward and
    backward, against a dense matmul of the same FLOPs: the median seconds and TFLOP/s of
    each, and the grouped result's largest difference from a loop over the experts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import grouped
    from .plan import Plan

    plan = Plan.resolve(cfg)
    if not plan.experts:
        raise ConfigError("model.num_experts", "--experts needs an MoE model (num_experts > 0)")
    m, deg, kernel = plan.cfg.model, plan.degrees, plan.experts[0]
    ep = deg.expert
    e = m.num_experts // ep
    rows = ep * plan.tokens_per_microbatch * min(m.experts_per_token, e) // e * e
    d, f = m.d_model, m.expert_width // deg.tensor
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (rows, d), m.dtype)
    w = jax.random.normal(keys[1], (e, d, f), m.dtype) / d ** 0.5
    ct = jax.random.normal(keys[2], (rows, f), m.dtype)
    sizes = jnp.full((e,), rows // e, jnp.int32)
    if kernel == "capacity":  # fixed buffers: a batched matmul
        def experts(x, w):
            return jnp.einsum("ecd,edf->ecf", x.reshape(e, -1, d), w).reshape(rows, f)
    else:
        def experts(x, w):
            return grouped.matmul(kernel)(x, w, sizes)

    def run(fn, *args):
        def loss(*args):
            out = fn(*args)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out
        step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
        result = jax.block_until_ready(step(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append(time.perf_counter() - start)
        return result[1], statistics.median(times)

    out, grouped_s = run(experts, x, w)
    _, dense_s = run(jnp.dot, x, w[0])
    ref = jnp.concatenate([jnp.dot(a, b) for a, b in zip(jnp.split(x, e), w)])
    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    flops = 3 * 2 * rows * d * f  # forward, and the two gradients
    return {"kernel": kernel, "dtype": m.dtype, "rows": rows, "experts": e, "d": d, "f": f,
            "grouped_s": grouped_s, "dense_s": dense_s,
            "grouped_tflops": flops / grouped_s / 1e12, "dense_tflops": flops / dense_s / 1e12,
            "error": float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))}
