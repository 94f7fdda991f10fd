"""`python -m spmd3d.plan CONFIG --search`: the layouts of a model on a cluster, ranked.

The model and the batch (global batch, sequence length) are the config's; the search varies the
layout: the mesh (data, stage, tensor, seq; HSDP's copies where data spans nodes; for an MoE
model its expert-parallel degree too), the ZeRO stage, the pipeline's schedule and repeats,
the microbatches, remat, sequence parallelism and, with the sequence split, the ring or
Ulysses (`parallel.context`). Every candidate the config's checks accept is
estimated by arithmetic (`estimate.py`, about a millisecond each), those that need more than
`FIT` of a device's memory are dropped and the rest ranked by predicted step time.

tensor stays inside a node (it talks every layer), and so does seq, unless tensor fills the
node first and the ring crosses nodes (`mesh.inside=tensor`, long context's layout). The
ZeRO stage changes only memory and the communication over data: of the four, the table keeps
the fastest that fits (the lowest of equals) for each of the other choices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import Config, ConfigError
from . import Plan, estimate

ACROSS_MIN_TOKENS = 8192  # a device's tokens of a sequence below which seq stays in a node
FIT = 0.9  # of a device's memory a layout may plan for: the rest is the runtime's (CUDA
# context, NCCL buffers, the allocator's fragmentation)
REMATS = ("none", "save_dots", "full", "offload", "stage")  # least recompute first
SCHEDULES = (("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("1f1b", 2), ("1f1b", 4), ("zb_h1", 1),
             ("zb_h1", 2))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cfg: Config, per_node: int, devices: int):
    """{data, stage, tensor, seq, expert, replicate} of every mesh of `devices` with tensor x
    seq inside a node, or tensor inside and seq across nodes (`inside`: tensor); for an MoE
    model each with every expert-parallel degree (`expert`: dividing data and the expert
    count); each also with HSDP where its data devices span nodes (`_with_hsdp`)."""
    m, t = cfg.model, cfg.train
    for tensor in _divisors(min(per_node, devices)):
        if m.num_kv_heads % tensor or m.d_ff % tensor or m.vocab_size % tensor or (
                m.is_moe and m.expert_width % tensor):
            continue
        for seq in _divisors(devices // tensor):
            across = tensor * seq > per_node  # only for long context: ring steps of a tile or more
            if (devices % (tensor * seq) or (seq > 1 and t.seq_len % (2 * seq))
                    or (across and (per_node % tensor or seq % (per_node // tensor)
                                    or t.seq_len // seq < ACROSS_MIN_TOKENS))):
                continue
            for stage in _divisors(devices // (tensor * seq)):
                data = devices // (tensor * seq * stage)
                if stage > m.stacked_layers or t.global_batch % data:
                    continue
                mesh = {"data": data, "stage": stage, "tensor": tensor, "seq": seq,
                        "replicate": 1, **({"inside": "tensor"} if across else {})}
                for expert in _divisors(data) if m.is_moe else (1,):
                    if m.num_experts % expert == 0 or not m.is_moe:
                        yield from _with_hsdp({**mesh, "expert": expert}, per_node, devices)


def _with_hsdp(mesh: dict, per_node: int, devices: int):
    """The mesh, and where its data devices span nodes its HSDP variant: ZeRO over the data
    devices of a node (`mesh.replicate`: one copy of the sharded state per node's group)."""
    from ..mesh import DATA, axis_names, split_over_hosts
    yield mesh
    if devices <= per_node or devices % per_node:
        return
    sizes = {DATA: mesh["data"] // mesh["expert"], "stage": mesh["stage"],
             "tensor": mesh["tensor"], "seq": mesh["seq"],
             **({"expert": mesh["expert"]} if mesh["expert"] > 1 else {})}
    _, outer = split_over_hosts(sizes, per_node, devices // per_node, True,
                                mesh.get("inside", "seq"))
    copies = outer[axis_names(sizes).index(DATA)]
    if 1 < copies < sizes[DATA]:  # (all copies, a group of one: plain data parallelism)
        yield {**mesh, "replicate": copies}


def pipelines(cfg: Config, mesh: dict):
    """(schedule, repeats, microbatches) for a mesh: no pipeline (stage 1) accumulates any
    divisor of a data shard's rows; a pipeline runs at least one microbatch per stage."""
    rows = cfg.train.global_batch // mesh["data"]
    p = mesh["stage"]
    if p == 1:
        for micro in _divisors(rows):
            yield "gpipe", 1, micro
        return
    for kind, repeats in SCHEDULES:
        if p * repeats > cfg.model.stacked_layers:
            continue
        for micro in _divisors(rows):
            if micro >= p and (repeats == 1 or micro % p == 0):
                yield kind, repeats, micro


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    estimate: dict

    @property
    def step_s(self) -> float:
        return self.estimate["time"]["step_s"]

    @property
    def needed(self) -> int:
        return self.estimate["memory"]["needed_bytes"]

    def key(self) -> tuple:
        """What the layout is, as the config spells it (to find a layout in the ranking)."""
        c = self.plan.cfg
        s = self.plan.schedule
        deg = self.plan.degrees
        return ((deg.batch, deg.stage, deg.tensor, deg.seq, deg.expert, deg.replicate),
                c.parallel.zero_stage, c.parallel.sequence_parallel, c.parallel.remat,
                (s.kind, s.repeats) if s else None, c.train.microbatches, c.parallel.context)


def _layout(cfg: Config, mesh: dict, kind: str, repeats: int, micro: int, sp: bool,
            zero: int, remat: str, context: str = "ring") -> Config:
    return replace(
        cfg, mesh=replace(cfg.mesh, **mesh),
        parallel=replace(cfg.parallel, zero_stage=zero, sequence_parallel=sp, remat=remat,
                         pipeline_schedule=kind, pipeline_repeats=repeats, context=context),
        train=replace(cfg.train, microbatches=micro))


def evaluate(cfg: Config, topology) -> Candidate:
    plan = Plan.resolve(cfg, topology=topology)
    return Candidate(plan, estimate.estimate(plan))


def _choices(mesh: dict):
    """(sequence parallelism, remat, context) for a mesh: SP with tensor only, the ring or
    Ulysses with seq only (Ulysses where the kv heads divide: the plan refuses it elsewhere)."""
    for sp in (False, True) if mesh["tensor"] > 1 else (False,):
        for remat in REMATS:
            for context in ("ring", "ulysses") if mesh["seq"] > 1 else ("ring",):
                yield sp, remat, context


def search(cfg: Config, topology, devices: int) -> dict:
    """{ranked: fitting Candidates fastest first, tried, valid, smallest: the Candidate that
    needs least memory (fitting or not)}."""
    limit = FIT * topology.device_memory_gb * 1e9
    ranked, tried, valid, smallest = [], 0, 0, None
    for mesh in meshes(cfg, topology.devices_per_node, devices):
        for kind, repeats, micro in pipelines(cfg, mesh):
            for sp, remat, context in _choices(mesh):
                best = None  # the fastest ZeRO stage that fits (the lowest of equals)
                for zero in range(4):
                    tried += 1
                    try:
                        c = evaluate(_layout(cfg, mesh, kind, repeats, micro, sp, zero, remat,
                                             context), topology)
                    except ConfigError:
                        continue
                    valid += 1
                    if smallest is None or c.needed < smallest.needed:
                        smallest = c
                    if c.needed <= limit and (best is None or c.step_s < best.step_s):
                        best = c
                if best is not None:
                    ranked.append(best)
    ranked.sort(key=lambda c: (c.step_s, c.needed))
    return {"ranked": ranked, "tried": tried, "valid": valid, "smallest": smallest}


def describe(c: Candidate) -> dict:
    """One row of the table, as plain data (the JSON record's too)."""
    p, t = c.plan, c.estimate["time"]
    s, par = p.schedule, p.cfg.parallel
    mesh = {**dict(p.mesh.shape), "data": p.cfg.mesh.data,  # all the data devices
            **({"expert": p.cfg.mesh.expert} if p.cfg.model.is_moe else {})}
    return {"mesh": mesh, "zero": par.zero_stage, "sp": par.sequence_parallel,
            "schedule": f"{s.kind} v{s.repeats}" if s else "none",
            "microbatches": p.cfg.train.microbatches, "remat": par.remat,
            "context": p.attention if p.degrees.seq > 1 else "-",
            "needed_gb": c.needed / 1e9, "step_s": t["step_s"], "mfu": t["mfu"],
            "bubble_s": t["bubble_s"], "recompute_s": t["recompute_s"],
            "exposed_comm_s": t["exposed_comm_s"]}


HEADER = (f"{'rank':>4}  {'data':>5} {'copies':>6} {'expert':>6} {'stage':>5} {'tensor':>6} "
          f"{'seq':>3} "
          f"{'context':<7}  "
          f"{'ZeRO':>4}  "
          f"{'SP':<3}  {'schedule':<9} {'micro':>5}  {'remat':<9} {'GB':>6}  {'step s':>7}  "
          f"{'MFU':>6}   {'bubble':>7} {'recompute':>9} {'comm':>7}")


def row(rank, d: dict) -> str:
    m = d["mesh"]
    return (f"{rank:>4}  {m['data']:>5} {m.get('replicate', 1):>6} {m.get('expert', 1):>6} "
            f"{m['stage']:>5} {m['tensor']:>6} "
            f"{m['seq']:>3} {d.get('context', '-'):<7}  "
            f"{d['zero']:>4}  {'yes' if d['sp'] else 'no':<3}  {d['schedule']:<9} "
            f"{d['microbatches']:>5}  {d['remat']:<9} {d['needed_gb']:>6.1f}  {d['step_s']:>7.3f}  "
            f"{d['mfu']:>6.1%}   {d['bubble_s']:>7.3f} {d['recompute_s']:>9.3f} "
            f"{d['exposed_comm_s']:>7.3f}")


def rank_of(ranked: list, c: Candidate) -> int | None:
    """1 + the fitting layouts faster than `c` (None if `c` does not fit)."""
    return 1 + sum(r.step_s < c.step_s for r in ranked)


def _why(best: dict, other: dict) -> str:
    """Seconds `best` loses less (-) or more (+) than `other` to each of the step's losses."""
    return ", ".join(f"{name} {best[k] - other[k]:+.3f} s" for name, k in (
        ("bubble", "bubble_s"), ("recompute", "recompute_s"),
        ("exposed communication", "exposed_comm_s")))


def run(cfg: Config, topology, devices: int, top: int,
        own: Candidate | None) -> tuple[list, dict, list]:
    """(the report's lines, the record, the ranked Candidates) of a search; `own` is the config's layout, ranked
    among the rest. Raises ConfigError when no layout fits."""
    import time

    start = time.perf_counter()
    found = search(cfg, topology, devices)
    seconds = time.perf_counter() - start
    ranked, limit = found["ranked"], FIT * topology.device_memory_gb
    if not ranked:
        s = found["smallest"]
        if s is None:
            raise ConfigError("--devices", f"no layout of this model and batch on {devices} "
                                           "devices passes the config's checks")
        d = describe(s)
        raise ConfigError("--search", (
            f"no layout of this model on {devices} devices fits in {limit:.0f} GB "
            f"({FIT:.0%} of a {topology.name} device); the smallest needs "
            f"{d['needed_gb']:.1f} GB (mesh {d['mesh']}, ZeRO-{d['zero']}, remat {d['remat']})"))
    rows = [describe(c) for c in ranked[:top]]
    lines = [f"searched {found['tried']} layouts of {devices} devices in {seconds:.1f} s: "
             f"{found['valid']} valid, {len(ranked)} fit in {limit:.0f} GB ({FIT:.0%} of a "
             "device); fastest first (bubble, recompute and exposed communication: seconds "
             "of the step lost to each)", HEADER]
    lines += [row(i + 1, d) for i, d in enumerate(rows)]
    record = {"devices": devices, "tried": found["tried"], "valid": found["valid"],
              "fitting": len(ranked), "seconds": seconds, "top": rows}
    if own is not None:
        d = describe(own)
        fits = own.needed <= limit * 1e9
        rank = rank_of(ranked, own) if fits else None
        record["config_layout"] = {**d, "rank": rank}
        lines += ["the config's own layout:", row(rank or "-", d)]
        lines.append(f"  rank {rank} of {len(ranked)}; the fastest saves "
                     f"{d['step_s'] - rows[0]['step_s']:.3f} s a step: {_why(rows[0], d)}"
                     if fits else f"  does not fit: needs {d['needed_gb']:.1f} GB of "
                                  f"{limit:.0f}")
    return lines, record, ranked
