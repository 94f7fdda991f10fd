"""`python -m spmd3d.bench [CONFIG.yaml] [key=value ...] [--steps=N] [--warmup=N] [--bubble]
[--checkpoint] [--attention] [--experts] [--profile=DIR] [--json]`

Throughput, MFU, compile time, per-device memory and the collectives of one compiled train
step, for a named config and mesh. The timed loop runs the step alone: batches are built on
device beforehand (host data loading is not what we measure), warmup steps absorb first-call
costs, and every timed step is blocked on so each time is one whole step. The median is the
headline number because other work on a shared machine inflates the mean.
`--checkpoint` also times checkpoint saves (the part that blocks training and the whole write,
asynchronous and synchronous) and a restore with its fingerprint check.
`--bubble` (with `mesh.stage > 1`) also compiles the step with its loops unrolled and reports
the pipeline's per-device FLOPs over the unpipelined step's next to the schedule's theory.
`--attention` runs one layer's attention of the config (a device's share of heads and rows)
through the fused kernel (cuDNN on a GPU; JAX's reference of the same call elsewhere) and the
blocked one: the largest differences of the output and of the gradients, and the time of each.
`--experts` (an MoE model) runs one layer's grouped matmul as a device does, through the
plan's kernel, against a dense matmul of the same FLOPs: the TFLOP/s of each.
`--profile=DIR` traces two more steps after the timed ones with `jax.profiler` into DIR and
prints where their time went, per category and per instruction (see `profile.py`).
With `--json` the last stdout line is one JSON object (`run_bench`'s record) for scripts.
Exit status: 0 done, 2 invalid configuration or input (one line, no traceback), 1 anything else.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

from . import cli
from . import config as config_lib
from .config import Config, ConfigError
from .mesh import simulate_devices
from .microbench import measure_attention, measure_experts
from .units import gib

COMMAND = cli.Command(
    prog="python -m spmd3d.bench",
    usage="[CONFIG.yaml] [key=value ...] [--steps=N] [--warmup=N] [--bubble] [--checkpoint] "
          "[--attention] [--experts] [--profile=DIR] [--json]",
    description=("Throughput, MFU, compile time, per-device memory and the collectives of one "
                 "compiled train step of a config on its mesh. The median step time is the "
                 "headline. Exit status 0 done, 2 bad configuration or input (one line), 1 "
                 "anything else."),
    flags=(
        cli.Flag("--steps", "int", "timed steps (default 10)", minimum=1),
        cli.Flag("--warmup", "int", "untimed steps first (default 2)", minimum=0),
        cli.Flag("--bubble", help="with mesh.stage > 1: the pipeline's FLOPs against theory"),
        cli.Flag("--checkpoint", help="also time checkpoint saves (async, sync) and a restore"),
        cli.Flag("--attention", help="the fused attention kernel against the blocked one: "
                                     "differences and times"),
        cli.Flag("--experts", help="MoE: the experts' grouped matmul against a dense one of the "
                                   "same FLOPs: TFLOP/s of each"),
        cli.Flag("--profile", "str", "trace two more steps with jax.profiler into DIR"),
        cli.Flag("--json", help="the last stdout line is the record as one JSON object"),
    ),
)


def bubble_plan(cfg: Config):
    """The plan of `cfg` if `--bubble` can measure its schedule, else its ConfigError: asked
    before the benchmark runs, so that a bad flag costs no compile."""
    from .plan import Plan

    plan = Plan.resolve(cfg)
    if plan.schedule is None:
        raise ConfigError("mesh.stage", "--bubble needs a pipeline (mesh.stage > 1)")
    if plan.schedule.mode == "switch":  # measured: a 3-way switch of 0, 1, 2 matmuls counts 2
        raise ConfigError("parallel.pipeline_schedule", "--bubble reads XLA's cost analysis, "
                          "which counts a conditional as its costliest branch: zb_h1's "
                          "per-device switch has no FLOP figure to compare")
    return plan


def measure_bubble(cfg: Config) -> dict:
    """Measured vs theoretical FLOP overhead of the pipeline schedule of `cfg`.

    Per-device FLOPs of L layers under the pipeline, times p, over those of the same L layers
    without a pipeline (on the devices of one stage); each is the step with 2L layers less the
    step with L, so what does not depend on the depth (embedding, head, loss, optimizer)
    cancels.
    """
    import jax

    from . import hlo
    from .manual import unrolled_loops
    from .runtime import setup

    plan = bubble_plan(cfg)
    cfg, schedule = plan.cfg, plan.schedule
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats

    def flops(c):
        job = setup(c, jax.devices()[: c.mesh.num_devices])
        with unrolled_loops():  # cost analysis counts a loop body once
            return hlo.flops(job.compile()[0])

    def stack(c):
        deeper = config_lib.override(c, model={"num_layers": 2 * c.model.num_layers})
        return flops(deeper) - flops(c)

    # a circular GPipe recomputes each stage in the backward: so does the baseline then
    # (interleaved 1F1B keeps its residuals, as 1F1B does)
    circular = schedule.recomputes_stage
    remat = "stage" if circular and cfg.parallel.remat == "none" else cfg.parallel.remat
    base = config_lib.override(cfg, mesh={"stage": 1}, train={"microbatches": 1},
                               parallel={"pipeline_repeats": 1, "remat": remat})
    measured = stack(cfg) * p / stack(base)
    return {"p": p, "m": m, "v": v, "measured": measured, "theory": schedule.flops_ratio}


def measure_checkpoint(cfg: Config, saves: int = 3) -> dict:
    """Median seconds per checkpoint save -- `blocking_s`, until training may go on (device to
    host copy, fingerprints), and `total_s`, until committed on disk -- with `checkpoint.async`
    on and off, plus one restore (read, re-shard onto the mesh, fingerprint check).
    `committed_on_return`: whether each save's step was listed as committed when `save`
    returned (always for a synchronous save; for an asynchronous one only if its write won
    the race)."""
    import tempfile

    import jax

    from .checkpoint import Checkpointer, directory_bytes
    from .resume import restore_or_init
    from .runtime import setup

    job = setup(cfg)
    state = job.init_state()
    state, _ = job.step_fn(state, job.global_batch(0))  # Adam moments of zeros would compress
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("async", "sync"):
            ckpt = Checkpointer(Path(tmp) / mode, every=1, keep=2, async_save=mode == "async")
            blocking, total, committed = [], [], []
            for step in range(saves + 1):  # the first save compiles the fingerprint; not timed
                start = time.perf_counter()
                ckpt.save(step, job.entries(state), {"step": step})
                returned = time.perf_counter()
                committed.append(ckpt.latest_step() == step)
                ckpt.wait()
                if step:
                    blocking.append(returned - start)
                    total.append(time.perf_counter() - start)
            out[mode] = {"blocking_s": statistics.median(blocking),
                         "total_s": statistics.median(total),
                         "committed_on_return": all(committed)}
            if mode == "sync":
                out["bytes"] = directory_bytes(Path(tmp) / mode / str(saves))
                start = time.perf_counter()
                restored, *_ = restore_or_init(job, ckpt, log=lambda *a: None)
                jax.block_until_ready(restored)
                out["restore_s"] = time.perf_counter() - start
            ckpt.close()
    return out


def run_bench(cfg: Config, steps: int = 10, warmup: int = 2, name: str = "default",
              profile_dir: str | None = None) -> dict:
    """Compile, warm up and time `steps` train steps of `cfg` on all devices; the JSON record
    (`name` labels it: main passes the config file's stem). With `profile_dir`, two more steps
    run under `jax.profiler` (after the timed ones, which it would slow down)."""
    import jax

    from . import hlo
    from .metrics import mfu
    from .runtime import setup

    job = setup(cfg)
    cfg = job.cfg
    compiled, compile_s = job.compile()
    state = job.init_state()
    batches = jax.block_until_ready([job.global_batch(s) for s in range(warmup + steps)])

    for batch in batches[:warmup]:
        state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    times = []
    for batch in batches[warmup:]:
        start = time.perf_counter()
        state, metrics = compiled(state, batch)  # state is donated: no copy per step
        metrics["loss"].block_until_ready()
        times.append(time.perf_counter() - start)
    profiled = None
    if profile_dir:
        from . import profile
        traced = batches[warmup:][:2]
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for batch in traced:
                state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
        profiled = profile.summarize(profile.trace_file(profile_dir), compiled.as_text(),
                                     steps=len(traced))

    median, n_dev = statistics.median(times), job.plan.num_devices
    tokens_per_s = job.plan.tokens_per_step / median
    stats = jax.devices()[0].memory_stats()  # None on CPU
    colls = hlo.summary(hlo.collectives(compiled.as_text(), job.mesh.shape))
    return {
        "config": name,
        "cfg": config_lib.to_dict(cfg),  # the whole config: `plan --calibrate` replans it
        "mesh": dict(job.mesh.shape),
        "devices": n_dev,
        "device_kind": jax.devices()[0].device_kind,
        "dtype": cfg.model.dtype,
        "zero_stage": cfg.parallel.zero_stage,
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "remat": cfg.parallel.remat,
        "scan_layers": cfg.parallel.scan_layers,
        "microbatches": cfg.train.microbatches,
        "tokens_per_step": job.plan.tokens_per_step,
        "params": trained_params(job.abstract.params),
        "compile_s": compile_s,
        "steps": steps,
        "step_time_median_s": median,
        "step_time_mean_s": statistics.fmean(times),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, cfg.model, cfg.train.seq_len, job.peak_flops),
        "peak_tflops": job.peak_flops / 1e12,
        "peak_dtype": job.plan.peak_dtype,
        **({"fp8_gemms": hlo.fp8_gemms(compiled.as_text())} if cfg.model.fp8 != "off" else {}),
        "memory": hlo.memory(compiled),
        "peak_bytes": (stats or {}).get("peak_bytes_in_use"),
        "collectives": [{"kind": k, "axes": list(a), "count": n}
                        for (k, a), n in sorted(colls.items())],
        **({"profile": profiled} if profiled else {}),
    }


def trained_params(params) -> int:
    """Parameters the optimizer trains: not the `Untrained` state (an MoE router's bias and
    statistics probe, FP8's amax histories and probes)."""
    import jax
    from flax import nnx

    from .untrained import Untrained

    return sum(math.prod(v.shape) for v in
               jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
               if not isinstance(v, Untrained))


def format_report(r: dict) -> str:
    """The record as a few human-readable lines."""
    mem = r["memory"]
    colls = ", ".join(f"{c['kind']}[{','.join(c['axes']) or '-'}] x{c['count']}"
                      for c in r["collectives"]) or "none"
    lines = [
        f"bench {r['config']}: mesh {r['mesh']} on {r['devices']} x {r['device_kind']}",
        f"  {r['dtype']}, ZeRO-{r['zero_stage']}, SP {r['sequence_parallel']}, "
        f"remat {r['remat']}, layers {'scanned' if r['scan_layers'] else 'unrolled'}, "
        f"microbatches {r['microbatches']}, {r['params']:,} parameters",
        f"  compile     {r['compile_s']:.2f} s",
        f"  step time   median {r['step_time_median_s'] * 1e3:.1f} ms, "
        f"mean {r['step_time_mean_s'] * 1e3:.1f} ms over {r['steps']} steps",
        f"  throughput  {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}% of "
        f"{r['peak_tflops']:,.1f} TFLOP/s {r.get('peak_dtype', r['dtype'])} peak (causal "
        f"attention counted half)",
        f"  memory/dev  args {gib(mem['argument_bytes'])}, out {gib(mem['output_bytes'])}, "
        f"temp {gib(mem['temp_bytes'])}, total {gib(mem['total_bytes'])}",
    ]
    if r["peak_bytes"] is not None:
        lines.append(f"  peak in use {gib(r['peak_bytes'])} (device 0)")
    lines.append(f"  collectives {colls}")
    if "fp8_gemms" in r:
        lines.append(f"  fp8 GEMMs   {r['fp8_gemms']} in the compiled step")
    if "checkpoint" in r:
        c = r["checkpoint"]
        lines.append(f"  checkpoint  {c['bytes'] / 2**20:.1f} MiB: async save blocks "
                     f"{c['async']['blocking_s']:.3f} s (written in {c['async']['total_s']:.3f} s), "
                     f"sync save {c['sync']['total_s']:.3f} s, restore {c['restore_s']:.3f} s")
    if "profile" in r:
        from .profile import format_summary
        lines.extend(format_summary(r["profile"]))
    if "attention" in r:
        a, s = r["attention"], r["attention"]["shape"]
        errors = ", ".join(f"{k} {v:.1e}" for k, v in a["error"].items())
        lines.append(f"  attention   fused ({a['implementation']}) {a['fused_s'] * 1e3:.2f} ms vs "
                     f"blocked {a['blocked_s'] * 1e3:.2f} ms forward + backward, {a['dtype']}, "
                     f"{s['rows']} x {s['T']} tokens, {s['kv_heads']} x {s['groups']} heads of "
                     f"{s['head_dim']}; max |fused - blocked| / max |blocked|: {errors}")
        d = a["documents"]
        pallas = (f", Pallas (document ids) {d['pallas_s'] * 1e3:.2f} ms (error "
                  f"{max(d['pallas_error'].values()):.1e})" if d["pallas_s"] else "")
        lines.append(f"  documents   packed, fused (a dense mask) {d['fused_s'] * 1e3:.2f} ms"
                     f"{pallas} vs blocked {d['blocked_s'] * 1e3:.2f} ms; max |fused - blocked| / "
                     f"max |blocked|: {', '.join(f'{k} {v:.1e}' for k, v in d['error'].items())}")
    if "experts" in r:
        x = r["experts"]
        dw = x.get("weight_grad")
        how = x["kernel"] + (f", weight gradient {dw}" if dw else "")
        lines.append(f"  experts     grouped matmul ({how}) {x['grouped_tflops']:.1f} "
                     f"TFLOP/s vs dense {x['dense_tflops']:.1f}, forward + backward, {x['dtype']}, "
                     f"{x['rows']} rows over {x['experts']} experts of {x['d']} x {x['f']}; "
                     f"max |grouped - loop| / max |loop| {x['error']:.1e}")
    if "bubble" in r:
        b = r["bubble"]
        lines.append(f"  pipeline    p={b['p']} m={b['m']} v={b['v']}: FLOPs x{b['measured']:.4f} "
                     f"of unpipelined, theory (v*m+p-1)/(v*m) = {b['theory']:.4f}")
    return "\n".join(lines)


def _run(args: cli.Args) -> int:
    import logging

    from . import gpu

    cfg = args.load_config()
    simulate_devices(cfg.mesh.simulated_devices)
    for line in gpu.apply(cfg):  # XLA_FLAGS and the optimization level, before jax starts
        logging.getLogger("spmd3d").info(line)
    name = Path(args.config).stem if args.config else "default"
    if args.flags.get("--bubble"):
        bubble_plan(cfg)  # its mistakes before the benchmark's compile
    record = run_bench(cfg, steps=args.flags.get("--steps", 10), warmup=args.flags.get("--warmup", 2),
                       name=name, profile_dir=args.flags.get("--profile"))
    if args.flags.get("--bubble"):
        record["bubble"] = measure_bubble(cfg)
    if args.flags.get("--checkpoint"):
        record["checkpoint"] = measure_checkpoint(cfg)
    if args.flags.get("--attention"):
        record["attention"] = measure_attention(cfg)
    if args.flags.get("--experts"):
        record["experts"] = measure_experts(cfg)
    return cli.report(format_report(record), record, bool(args.flags.get("--json")))


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
