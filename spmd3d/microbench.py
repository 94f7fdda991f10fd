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
            return grouped.matmul(kernel, m.expert_weight_grad)(x, w, sizes)

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
    return {"kernel": kernel, "weight_grad": "" if kernel == "capacity" else m.expert_weight_grad,
            "dtype": m.dtype, "rows": rows, "experts": e, "d": d, "f": f,
            "grouped_s": grouped_s, "dense_s": dense_s,
            "grouped_tflops": flops / grouped_s / 1e12, "dense_tflops": flops / dense_s / 1e12,
            "error": float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))}


# The grouped-matmul kernels compared on one GPU (`python -m spmd3d.microbench`): the MoE
# bench rows' shapes, (rows, D, F, experts) of one layer's gate/up and down matmuls as one
# device runs them: coarse (1B widths, 8 experts of 4096, top-2, 16,384 tokens) and
# fine-grained (Qwen3-30B-A3B widths: 128 experts of 768, top-8)
SHAPES = {"coarse_gate_up": (32768, 2048, 4096, 8), "fine_gate_up": (131072, 2048, 768, 128),
          "coarse_down": (32768, 4096, 2048, 8), "fine_down": (131072, 768, 2048, 128)}


def _sizes(rows: int, groups: int, seed: int):
    """Uneven group sizes as a router makes them (softmax of normal logits, one expert
    idle), summing to `rows` less 1 % (the rows past the groups: other devices' assignments)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(0, 0.5, groups))
    p[groups // 2] = 0
    return rng.multinomial(rows - rows // 100, p / p.sum()).astype(np.int32)


def _timed(fn, args, repeats: int = 10) -> float:
    """Median seconds of one call: batches of `repeats` dispatched back to back."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = [fn(*args) for _ in range(repeats)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def grouped_candidates():
    """{op: {name: fn(a, b, sizes)}}: each grouped-matmul kernel this machine has, for the
    forward (`x[M, D] @ w[g, D, F]`), the input's gradient (`dy[M, F] @ w[g, D, F]^T`) and the
    weights' (`x[rows of g]^T @ dy[rows of g]`). Kernels that need a package or a GPU that
    is not there are left out."""
    import functools
    import importlib.util

    import jax

    from . import grouped, tgmm

    dims = {"dx": grouped._DX, "dw": grouped._DW}
    out = {"dw": {"xla": functools.partial(_general, dims=dims["dw"]),
                  **{f"pallas {'x'.join(map(str, b))}": functools.partial(
                      _tgmm, blocks=b, interpret=jax.default_backend() != "gpu")
                     for b in tgmm.CANDIDATES}},
           "fwd": {"xla": jax.lax.ragged_dot},
           "dx": {"xla": functools.partial(_general, dims=dims["dx"])}}
    if importlib.util.find_spec("tokamax") is not None:
        import tokamax

        for impl in ("mosaic", "triton"):
            out["fwd"][f"tokamax {impl}"] = functools.partial(_tokamax, tokamax, impl, None)
            for op in ("dx", "dw"):
                out[op][f"tokamax {impl}"] = functools.partial(_tokamax, tokamax, impl, dims[op])
        out["dw"]["tokamax mosaic, zero-initialised"] = functools.partial(
            _tokamax, tokamax, "mosaic", dims["dw"], zero_initialize=True)
    if jax.default_backend() == "gpu":
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        out["fwd"]["mosaic_gpu (jax)"] = functools.partial(grouped._mosaic, transpose=False)
        out["dx"]["mosaic_gpu (jax)"] = functools.partial(grouped._mosaic, transpose=True)
        # it masks x's rows at the groups' edges only: rows past the groups zeroed first
        out["dw"]["mosaic_gpu (jax)"] = lambda x, g, s: transposed_ragged_dot_mgpu.\
            transposed_ragged_dot(grouped._in_groups(x, s), grouped._in_groups(g, s),
                                  group_sizes=s, **grouped.MOSAIC_BLOCKS)
    return out


def _general(a, b, sizes, dims):
    import jax

    return jax.lax.ragged_dot_general(a, b, sizes, dims, preferred_element_type=a.dtype)


def _tgmm(x, dy, sizes, blocks, interpret):
    from . import tgmm

    return tgmm.weight_gradient(x, dy, sizes, blocks=blocks, interpret=interpret)


def _tokamax(tokamax, impl, dims, a, b, sizes, **kw):
    if dims is None:
        return tokamax.ragged_dot(a, b, sizes, implementation=impl, **kw)
    return tokamax.ragged_dot_general(a, b, sizes, dims, implementation=impl, **kw)


def compare_grouped(shapes: dict | None = None, budget_s: float = 240.0,
                    dtype: str = "bfloat16", only: str = "") -> list[dict]:
    """Each candidate of `grouped_candidates` at each shape, the weights' gradient first at
    every shape (what matters most), then the forward, then the input's gradient: median
    seconds, TFLOP/s over the rows in the groups, and its error against the product in fp32
    on the same inputs (`_oracle`) (NaN in the rows past the groups, which every kernel must
    ignore; those rows of the forward and dx outputs are not compared): ||out - ref|| /
    ||ref||, the worst group's, and whether any NaN came out. Stops starting new candidates
    after `budget_s`."""
    import jax
    import numpy as np

    start, records = time.perf_counter(), []
    kernels = grouped_candidates()
    problems = {name: _problem(shape, dtype, seed) for seed, (name, shape) in
                enumerate((shapes or SHAPES).items()) if not only or only in name}
    for op, candidates in kernels.items():
        for name, p in problems.items():
            ref = np.asarray(jax.jit(_oracle, static_argnums=0)(op, *p["exact"][op], p["sizes"]))
            for kname, fn in candidates.items():
                if time.perf_counter() - start > budget_s:
                    return records
                record = {"shape": name, **p["shape"], "op": op, "kernel": kname,
                          "dtype": dtype}
                try:
                    call = jax.jit(fn)
                    args = (*p["inputs"][op], p["sizes"])
                    out = np.asarray(call(*args), np.float32)
                    if op != "dw":
                        out = np.where(p["past"], 0, out)
                    seconds = _timed(call, args)
                    record.update(seconds=seconds, tflops=p["flops"] / seconds / 1e12,
                                  nan=bool(np.isnan(out).any()),
                                  error=_rel(out, ref), worst_group=_worst_group(
                                      out, ref, np.asarray(p["sizes"]), op))
                except Exception as e:  # a kernel this jax or GPU cannot build: say which
                    record["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                records.append(record)
                print(_row(record), flush=True)
    return records


def _problem(shape, dtype, seed: int) -> dict:
    """One shape's operands: `inputs` (NaN past the groups) for each op, the same in fp32
    with 0 there for the oracle (`exact`), the group sizes and the FLOPs in the groups."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    m, d, f, g = shape
    sizes = jnp.asarray(_sizes(m, g, seed=seed))
    total = int(sizes.sum())
    past = jnp.arange(m)[:, None] >= total
    keys = jax.random.split(jax.random.key(seed), 3)
    x, dy = (jnp.where(past, 0, jax.random.normal(k, (m, n))).astype(dtype)
             for k, n in ((keys[0], d), (keys[1], f)))
    w = (jax.random.normal(keys[2], (g, d, f)) / d ** 0.5).astype(dtype)
    x_nan, dy_nan = (jnp.where(past, jnp.nan, v) for v in (x, dy))
    exact = {op: tuple(v.astype(jnp.float32) for v in vs)
             for op, vs in (("fwd", (x, w)), ("dx", (dy, w)), ("dw", (x, dy)))}
    return {"shape": {"rows": m, "in_groups": total, "d": d, "f": f, "groups": g},
            "sizes": sizes, "past": np.asarray(past), "flops": 2 * total * d * f, "exact": exact,
            "inputs": {"fwd": (x_nan, w), "dx": (dy_nan, w), "dw": (x_nan, dy_nan)}}


def _oracle(op, a, b, sizes):
    """`op` in fp32, one group at a time as a dense product of its rows (masked): XLA's own
    `ragged_dot_general` pads to [G, M, D] first, 128 GiB at the fine-grained shape."""
    import jax
    import jax.numpy as jnp

    ends = jnp.cumsum(sizes)
    rows = jnp.arange(a.shape[0])[:, None]
    hi = jax.lax.Precision.HIGHEST

    def masked(g):
        return jnp.where((rows >= ends[g] - sizes[g]) & (rows < ends[g]), a, 0)

    if op == "dw":
        return jax.lax.map(lambda g: jnp.dot(masked(g).T, b, precision=hi),
                           jnp.arange(sizes.shape[0]))
    w = b if op == "fwd" else jnp.swapaxes(b, 1, 2)
    return jax.lax.fori_loop(0, sizes.shape[0], lambda g, acc: acc + jnp.dot(
        masked(g), w[g], precision=hi), jnp.zeros((a.shape[0], w.shape[2]), jnp.float32))


def _rel(a, b) -> float:
    import numpy as np

    return float(np.linalg.norm(np.nan_to_num(a - b, nan=np.inf)) / max(np.linalg.norm(b),
                                                                          1e-30))


def _worst_group(out, ref, sizes, op) -> float:
    """The largest ||out - ref|| / ||ref|| over the non-empty groups."""
    import numpy as np

    ends = np.cumsum(sizes)
    worst = 0.0
    for gi, (lo, hi) in enumerate(zip(ends - sizes, ends)):
        if hi > lo:
            a, b = (out[gi], ref[gi]) if op == "dw" else (out[lo:hi], ref[lo:hi])
            worst = max(worst, _rel(a, b))
    return worst


def _row(r: dict) -> str:
    head = f"{r['shape']:15s} {r['op']:3s} {r['kernel']:34s}"
    if "failed" in r:
        return f"{head} failed: {r['failed']}"
    return (f"{head} {r['seconds'] * 1e3:8.3f} ms {r['tflops']:6.1f} TFLOP/s  error "
            f"{r['error']:.1e} (worst group {r['worst_group']:.1e}){'  NaN' if r['nan'] else ''}")


def main(argv: list[str] | None = None) -> int:
    """`python -m spmd3d.microbench [--small] [--only=NAME] [--budget=SECONDS] [--json=FILE]`:
    the grouped-matmul kernels at the bench shapes (`--small`: shapes a CPU runs in seconds, to
    check the script; `--only`: the shapes whose name holds NAME); no candidate starts after
    `--budget` seconds (default 240)."""
    import json
    import sys

    argv = sys.argv[1:] if argv is None else argv
    small = "--small" in argv
    shapes = ({"small_gate_up": (512, 128, 256, 4), "small_down": (512, 256, 128, 4)}
              if small else None)
    budget = float(next((a.split("=", 1)[1] for a in argv if a.startswith("--budget=")), 240))
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("--only=")), "")
    records = compare_grouped(shapes, budget_s=budget, dtype="float32" if small else "bfloat16",
                              only=only)
    for a in argv:
        if a.startswith("--json="):
            with open(a.split("=", 1)[1], "w") as fh:
                json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
