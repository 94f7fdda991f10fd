"""What one compiled train step needs per device: memory by kind and collectives per mesh axis.

`measure(cfg)` compiles the real step for the config's real device count on simulated CPU
devices, from abstract shapes (nothing is allocated), and reads `memory_analysis()` and the HLO.
Four departures from the real run, each stated in the report:

* bf16 compute is compiled as fp16, a 2-byte stand-in: XLA:CPU computes bf16 in fp32 and hoists
  the conversions, which would inflate the temporaries of a bf16 step;
* an MoE plan's tokamax kernels (which XLA:CPU cannot lower) compile as a stand-in with their
  buffers and FLOPs (`grouped.py`);
* layers are compiled scanned (`parallel.scan_layers`): XLA:CPU schedules unrolled layers with
  no regard to memory (four times a GPU's figure: docs/choices.md);
* above `MAX_SIMULATED` devices (what XLA:CPU can simulate), the `data` axis is cut (with the
  global batch, so a data shard keeps its rows), and the terms that shard over `data` (the
  ZeRO-sharded state, and gradients under ZeRO-2/3) are scaled back to the real axis.

The breakdown: parameters and optimizer state are the arguments' exact shard sizes; gradients
are the fp32 gradient tree's shards; pipeline buffers are the microbatches a stage feeds in
and collects, its belt and a circular pipeline's wrap-around slots; logits/loss is one piece
of the chunked loss: its fp32 logits, their softmax and the labels' one-hot; layers gathered
for the step are ZeRO-3's stage weights and their gradient under a pipeline;
saved activations are the rest of the temporaries (what the backward keeps, and transients).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import replace

from . import grouped
from .config import Config, ConfigError
from .units import gb

MAX_SIMULATED = 2048


def compiled_layout(cfg: Config, devices: int) -> tuple[Config, int]:
    """(the config to compile, the factor its `data` axis was cut by) for at most
    MAX_SIMULATED devices; bf16 compute becomes fp16 (see the module's docstring)."""
    m = cfg.model
    # XLA:CPU has no cuDNN: attention compiles as the blocked kernel (or the ring); nor FP8
    # GEMMs: the projections' casts and scales compile emulated
    model = replace(m, dtype="float16" if m.dtype == "bfloat16" else m.dtype,
                    param_dtype="float16" if m.param_dtype == "bfloat16" else m.param_dtype,
                    attention="blocked", fp8_emulate=True)
    fixed, rep = cfg.mesh.non_data, cfg.mesh.replicate
    data = devices // fixed

    def fewer(c):  # HSDP's copies go first: a device's shards stay what they are
        return rep // c if rep % c == 0 else rep

    cut = next((c for c in range(1, data + 1) if data % c == 0 and devices // c <= MAX_SIMULATED
                and (data // c) % (fewer(c) * cfg.mesh.expert) == 0), None)
    if cut is None:
        raise ConfigError("mesh", f"stage*tensor*seq = {fixed} devices alone exceed the "
                                  f"{MAX_SIMULATED} that XLA:CPU can simulate for --compile")
    mesh = replace(cfg.mesh, data=data // cut, replicate=fewer(cut), simulated_devices=0)
    train = replace(cfg.train, global_batch=cfg.train.global_batch // cut)
    parallel = replace(cfg.parallel, scan_layers=True)
    return replace(cfg, model=model, mesh=mesh, train=train, parallel=parallel), cut


def shard_bytes(tree, shardings) -> int:
    import jax

    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def state_terms(plan) -> dict:
    """Exact per-device bytes of parameters, optimizer state and fp32 gradients of a plan,
    from the shardings alone (an abstract mesh will do)."""
    import jax
    import jax.numpy as jnp

    from .sharding import shardings_for
    from .step import state_shardings

    _, abstract, shardings = state_shardings(plan)
    grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), abstract.params)
    terms = {"parameters": shard_bytes(abstract.params, shardings.params),
             "optimizer_state": shard_bytes(abstract.opt, shardings.opt),
             "gradients": shard_bytes(grads, shardings_for(abstract.params, plan.rules.grads,
                                                           plan.mesh))}
    if plan.cfg.model.is_moe:  # the routed experts' weights: per device, and in all
        mlp = abstract.params["blocks"]["mlp"]
        experts = [mlp[name] for name in ("w_gate_up", "w_down")]
        terms["expert_weights"] = shard_bytes(experts, [shardings.params["blocks"]["mlp"][name]
                                                        for name in ("w_gate_up", "w_down")])
        terms["expert_weights_total"] = sum(
            math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(experts))
    return terms


TEMPORARY_KINDS = ("gradients", "pipeline_buffers", "logits_loss", "gathered_layers",
                   "gathered_tables", "dense_activations")


def by_kind(plan, temp_bytes: int, state: dict | None = None) -> dict:
    """Per-device bytes by kind: the state terms, the working terms, and saved activations
    (and transients): the temporaries the other kinds leave."""
    from .plan.memory import working_terms

    kinds = {**(state or state_terms(plan)), **working_terms(plan)}
    kinds["saved_activations"] = max(temp_bytes - sum(kinds[k] for k in TEMPORARY_KINDS), 0)
    return kinds


def measure(cfg: Config, topology) -> dict:
    """Compile `cfg`'s step for its layout and return the report's record (see `format`)."""
    import jax

    from . import hlo
    from .plan import Plan
    from .step import compile_step, make_train_step, state_shardings

    real = Plan.resolve(cfg, topology=topology)
    n = real.num_devices
    compile_cfg, cut = compiled_layout(real.cfg, n)
    with grouped.standing_in(), tempfile.TemporaryDirectory() as dump, hlo.uncached():
        # a GPU plan's grouped-matmul kernel, on CPU devices; the buffers' live ranges dumped
        plan = Plan.resolve(compile_cfg, jax.devices()[: n // cut], topology=topology)
        graphdef, abstract, shardings = state_shardings(plan)
        compiled, seconds = compile_step(plan, make_train_step(plan, graphdef, shardings),
                                         abstract, shardings, hlo.dump_options(dump))
        live = hlo.live_temp_bytes(dump)

    mem = hlo.memory(compiled)
    terms_real, terms_compiled = state_terms(real), state_terms(plan)
    # the compiled figures with the data-sharded terms scaled back to the real data axis
    delta_args = sum(terms_real[k] - terms_compiled[k] for k in ("parameters", "optimizer_state"))
    delta_temp = terms_real["gradients"] - terms_compiled["gradients"]
    compiled_rec = {"argument_bytes": mem["argument_bytes"] + delta_args,
                    "temp_bytes": mem["temp_bytes"] + delta_temp,
                    "output_bytes": mem["output_bytes"] + delta_args,
                    "alias_bytes": mem["alias_bytes"] + delta_args,
                    # the most of the temporaries alive at once; XLA packs them into temp_bytes
                    "live_temp_bytes": None if live is None else live + delta_temp}
    kinds = by_kind(plan, compiled_rec["temp_bytes"], terms_real)
    colls = hlo.collectives(compiled.as_text(), plan.mesh.shape)
    counts, nbytes = hlo.summary(colls), hlo.bytes_by_axes(colls)
    per_axis = hlo.bytes_per_axis(colls, dict(plan.mesh.shape))
    return {
        "devices": n, "simulated_devices": n // cut, "data_cut": cut,
        "mesh": dict(real.mesh.shape), "compiled_mesh": dict(plan.mesh.shape),
        "dtype": real.cfg.model.dtype, "compiled_dtype": plan.cfg.model.dtype,
        "experts": plan.experts[0] if plan.experts else "",
        "scanned_for_compile": not real.cfg.parallel.scan_layers,
        "topology": topology.name, "device_memory_bytes": int(topology.device_memory_gb * 1e9),
        "compile_s": seconds, "compiled": compiled_rec, "by_kind": kinds,
        "platform": jax.devices()[0].platform,
        "needed_bytes": compiled_rec["argument_bytes"] + compiled_rec["temp_bytes"],
        "collectives": [{"kind": k, "axes": list(a), "count": c, "bytes": nbytes[(k, a)]}
                        for (k, a), c in sorted(counts.items())],
        # as the planner counts them (`hlo.bytes_per_axis`); `data` as compiled (cut or not)
        "collective_bytes_per_axis": per_axis,
    }


def format_report(r: dict) -> list[str]:
    """The record as the report's lines."""
    c, k = r["compiled"], r["by_kind"]
    lines = [f"compiled for {r['devices']} devices in {r['compile_s']:.1f} s on "
             f"{r['simulated_devices']} simulated CPU devices"]
    if r["compiled_dtype"] != r["dtype"]:
        lines.append(f"  {r['dtype']} compiled as {r['compiled_dtype']}, a 2-byte stand-in "
                     "(XLA:CPU would compute bf16 in fp32 and inflate the temporaries)")
    if r.get("experts") in ("tokamax", "mosaic"):
        lines.append(f"  the experts' {r['experts']} kernels compiled as a stand-in with their "
                     "buffers and FLOPs (XLA:CPU cannot lower them)")
    if r.get("scanned_for_compile"):
        lines.append("  layers compiled scanned, not unrolled: XLA:CPU schedules unrolled layers "
                     "with no regard to memory (a GPU's compiler does)")
    if r["data_cut"] > 1:
        lines.append(f"  compiled with data {r['compiled_mesh']['data']} (not "
                     f"{r['mesh']['data']}: XLA:CPU simulates at most {MAX_SIMULATED} devices) and "
                     "the global batch cut alike; ZeRO-sharded state and gradients scaled back")
    lines += [
        "per device (GB)",
        f"  arguments   {gb(c['argument_bytes'], 8)}   parameters {gb(k['parameters'])},"
        f" optimizer state {gb(k['optimizer_state'])}",
        f"  temporaries {gb(c['temp_bytes'], 8)}   gradients {gb(k['gradients'])},"
        f" saved activations and transients {gb(k['saved_activations'])},"
        f" logits/loss {gb(k['logits_loss'])},"
        f" pipeline buffers {gb(k['pipeline_buffers'])}"
        + (f", layers gathered for the step {gb(k['gathered_layers'])}"
           if k.get("gathered_layers") else ""),
        *([f"              of which alive at once at most {gb(c['live_temp_bytes'])}: the rest "
            "is how XLA packed them into one buffer"] if c.get("live_temp_bytes") else []),
        f"  outputs     {gb(c['output_bytes'], 8)}   (aliased to the donated state: "
        f"{gb(c['alias_bytes'])})",
        f"  needed      {gb(r['needed_bytes'], 8)}   arguments + temporaries; a device of "
        f"{r['topology']} has {r['device_memory_bytes'] / 1e9:.0f}",
    ]
    if "expert_weights" in k:
        from .mesh import Degrees

        deg = Degrees.of(r["mesh"])
        whole = k["expert_weights_total"] / (deg.expert * deg.tensor * deg.stage)
        lines.append(f"  expert weights {gb(k['expert_weights'])} of the parameters: all "
                     f"{gb(k['expert_weights_total'])} / (expert {deg.expert} x tensor "
                     f"{deg.tensor} x stage {deg.stage}) = {gb(whole)}"
                     + (", exactly" if k["expert_weights"] == whole else ""))
    lines.append("collectives per step (per device, loop trips counted)")
    for x in r["collectives"]:
        lines.append(f"  {','.join(x['axes']) or '?':<12} {x['kind']:<20} {x['count']:>7} ops "
                     f"{x['bytes'] / 1e9:10.3f} GB")
    return lines
