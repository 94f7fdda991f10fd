"""The plan: every decision a run derives from its config, made once.

`Plan.resolve(cfg, devices)` for a run, or `Plan.resolve(cfg, topology=...)` with no devices at
all (planning a 1024-device layout on a laptop: the mesh is then a `jax.sharding.AbstractMesh`,
enough to derive every sharding and to trace). The plan holds the config with `mesh.data`
resolved, the mesh, the topology, the ZeRO rule tables, the pipeline schedule (None without a
pipeline), the gradient-accumulation steps, the order the stacked layers are stored in, the
order of the sequence's positions and the attention kernel. State, step, model wiring,
checkpoint targets, bench and the API take a plan; none re-derives these from the raw config.
Frozen and hashable, so it can key caches of compiled functions.

`python -m spmd3d.plan [CONFIG.yaml] [key=value ...] [--compile] [--json]` (`__main__.py`)
prints the plan of a config on its topology; `--compile` compiles its step at full size on
simulated CPU devices and reports the memory per device and the collectives (`footprint.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from .. import grouped
from ..attention import choose, fallback
from ..config import Config, ConfigError, compute_dtype, resolve_mesh
from ..mesh import (FP8_PEAK, Degrees, Topology, abstract_mesh, load_topology, make_mesh,
                    split_over_hosts)
from ..pipeline import Schedule, layer_order
from ..ring import zigzag_order
from ..sharding import ZeroRules, zero_rules


def _platform(mesh, topology: Topology) -> tuple[str, float, bool]:
    """(platform, the GPUs' compute capability (0 for other devices), whether there are
    devices) of the mesh's devices; a plan without devices takes the topology's platform,
    and Hopper's 9.0 when the topology has an FP8 peak."""
    try:
        device = mesh.devices.flat[0]
    except ValueError:  # an AbstractMesh has no devices
        return topology.platform, 9.0 * (FP8_PEAK in dict(topology.peak_tflops)), False
    return device.platform, float(getattr(device, "compute_capability", None) or "0"), True


def _with_kernels(cfg: Config, mesh, topology: Topology,
                  documents: bool) -> tuple[Config, tuple, tuple]:
    """(cfg with `model.dtype` auto resolved: bf16 compute on a GPU, fp32 elsewhere, and
    `model.expert_kernel`; the attention kind, for packed `documents` or not, the kernel it
    runs locally (Ulysses' own; else the kind itself) and why documents fell back from pallas
    to cuDNN's dense mask (or ""); the experts' kernel and its warning, or () for a dense
    model) on the mesh's devices."""
    platform, capability, devices = _platform(mesh, topology)
    m, experts = cfg.model, ()
    if m.dtype == "auto":
        m = replace(m, dtype=compute_dtype(m.dtype, platform))
    if m.is_moe:
        experts = grouped.choose(m.expert_kernel, platform=platform,
                                 capacity_factor=m.capacity_factor, devices=devices,
                                 capability=capability, dtype=m.dtype)
        if experts[0] != "capacity":
            m = replace(m, expert_kernel=experts[0], expert_weight_grad=grouped.choose_weight_grad(
                m.expert_weight_grad, platform=platform))
    if m.fp8 != "off" and not m.fp8_emulate and not (platform == "gpu" and capability >= 9.0):
        raise ConfigError("model.fp8", f"FP8 GEMMs need a Hopper GPU or later (this run's "
                          f"devices are {'older GPUs' if platform == 'gpu' else platform}); "
                          f"model.fp8_emulate=true runs the same casts and scales with the "
                          f"GEMMs in {m.dtype}")
    cfg = replace(cfg, model=m)
    par = cfg.parallel  # a switch table runs each stage's layers inside a conditional
    branched = cfg.mesh.stage > 1 and Schedule(cfg.mesh.stage, cfg.train.microbatches,
                                               par.pipeline_repeats,
                                               par.pipeline_schedule).mode == "switch"
    shape = dict(platform=platform, dtype=m.dtype, head_dim=m.dim_per_head, seq=cfg.mesh.seq,
                 hopper=capability >= 9.0, seq_len=cfg.train.seq_len, stage=cfg.mesh.stage)
    # with tensor filling a node first, a seq group larger than what is left spans nodes
    across = (cfg.mesh.inside == "tensor"
              and cfg.mesh.tensor * cfg.mesh.seq > topology.devices_per_node)
    kind = choose(m.attention, branched=branched, documents=documents, context=par.context,
                  kv_heads=m.num_kv_heads // cfg.mesh.tensor, tensor=cfg.mesh.tensor,
                  across_nodes=across, **shape)
    # Ulysses runs a kernel of the whole sequence: the one chosen as if it were not split
    local = choose(m.attention, documents=documents, **{**shape, "seq": 1}) \
        if kind == "ulysses" else kind
    if local != kind:
        shape["seq"] = 1
    why = fallback(**shape) if documents and local == "cudnn" else ""
    return cfg, (kind, local, why), experts


def _document_eot(cfg: Config) -> int | None:
    """The end-of-text id that ends the documents packed in a window (`data.document_mask`),
    or None: off, or a tokenizer without one (bytes). A tokenizer that is not there yet
    (`convert import` plans the layout before it copies one) has none: the data's loading
    names it."""
    if not cfg.data.document_mask or cfg.data.tokenizer == "bytes":
        return None
    from ..schema import DataError
    from ..tokenizer import load

    try:
        return load(cfg.data.tokenizer).eos_id
    except DataError:
        return None


@lru_cache(maxsize=1024)
def _order(fn, *args) -> tuple:
    """fn(*args) as a tuple of ints, once per arguments: a search resolves thousands of plans
    with the same few orders (a sequence's zig-zag order is seq_len long)."""
    return tuple(int(i) for i in fn(*args))


@dataclass(frozen=True)
class Plan:
    cfg: Config  # `mesh.data` and `model.dtype` resolved
    mesh: object  # jax.sharding.Mesh, or AbstractMesh when planned without devices
    topology: Topology
    rules: ZeroRules
    schedule: Schedule | None  # the pipeline over `stage`, or None
    accum_steps: int  # microbatches accumulated one after another (1 with a pipeline)
    layer_order: tuple  # storage position -> canonical layer index (-1: a padding slot)
    seq_order: tuple | None  # global position at each place of the token layout (zig-zag)
    attention: str  # an `attention.KINDS` name
    attention_local: str  # the kernel it runs on a device's sequence (Ulysses': blocked, cudnn...)
    attention_fallback: str = ""  # why packed documents went to cuDNN's mask, not pallas
    experts: tuple = ()  # MoE: (the experts' kernel, `grouped.KERNELS` or capacity; a warning)
    eot: int | None = None  # packed documents end at this token (`data.document_mask`), or None

    @classmethod
    def resolve(cls, cfg: Config, devices=None, *, topology: str | Topology | None = None) -> "Plan":
        """The plan of `cfg` on `devices` (default: all of JAX's), or, given only a
        `topology` (a name in meshes/ or a Topology), on that cluster without any device."""
        if devices is None and topology is None:
            import jax

            devices = jax.devices()
        if devices is not None:
            devices = list(devices)
            cfg = resolve_mesh(cfg, len(devices))
            topo = topology if isinstance(topology, Topology) else load_topology(
                topology or cfg.mesh.topology, devices[0].platform)
            mesh = make_mesh(cfg.mesh.sizes(), devices, cfg.mesh.allow_cross_host,
                             cfg.mesh.inside)
        else:
            topo = topology if isinstance(topology, Topology) else load_topology(topology, "gpu")
            cfg = resolve_mesh(cfg, topo.num_devices if cfg.mesh.data == -1
                               else cfg.mesh.num_devices)
            total, per_node = cfg.mesh.num_devices, topo.devices_per_node
            if total > per_node:  # a layout over several nodes keeps tensor and seq inside one
                if total % per_node:
                    raise ConfigError("mesh", f"{total} devices are not whole nodes of {per_node}")
                split_over_hosts(cfg.mesh.sizes(), per_node, total // per_node,
                                 cfg.mesh.allow_cross_host, cfg.mesh.inside)
            mesh = abstract_mesh(cfg.mesh.sizes())
        return cls.of(cfg, mesh, topo)

    @classmethod
    def of(cls, cfg: Config, mesh, topology: Topology) -> "Plan":
        """The decisions for a resolved config on a given mesh."""
        eot = _document_eot(cfg)
        cfg, (attention, local, attention_fallback), experts = _with_kernels(
            cfg, mesh, topology, eot is not None)
        m, par, tr = cfg.mesh, cfg.parallel, cfg.train
        schedule = (Schedule(m.stage, tr.microbatches, par.pipeline_repeats, par.pipeline_schedule)
                    if m.stage > 1 else None)
        accum = 1 if schedule else tr.microbatches
        # ZeRO-1 accumulating microbatches keeps its accumulator sharded over data, as ZeRO-2:
        # with a replicated accumulator XLA all-reduced each microbatch's gradients and then
        # gathered the whole fp32 accumulator back (it had sharded the loop's carry for the
        # update), three times the bytes of reduce-scattering each microbatch's gradients once
        # (docs/choices.md)
        zero = 2 if par.zero_stage == 1 and accum > 1 else par.zero_stage
        # with a pipeline, the weights used outside it split over `stage` too (`zero_rules`)
        over_stage = schedule is not None and par.tables_over_stage
        return cls(
            cfg=cfg, mesh=mesh, topology=topology,
            rules=zero_rules(zero, par.sequence_parallel, expert=m.expert > 1,
                             replicate=m.replicate > 1, over_stage=over_stage),
            schedule=schedule,
            accum_steps=accum,
            layer_order=_order(layer_order, cfg.model.stacked_layers, m.stage,
                               par.pipeline_repeats),
            # the ring's zig-zag balances its causal work; Ulysses sees the whole sequence
            seq_order=(_order(zigzag_order, tr.seq_len, m.seq)
                       if m.seq > 1 and attention != "ulysses" else None),
            attention=attention,
            attention_local=local,
            attention_fallback=attention_fallback,
            experts=experts,
            eot=eot,
        )

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    @property
    def padded(self) -> bool:
        """Whether the stored stack has padding slots (stage x repeats does not divide L)."""
        return min(self.layer_order) < 0

    @property
    def active(self):
        """Which stored layer slots hold a layer (a tuple of bools), or None without padding."""
        return tuple(i >= 0 for i in self.layer_order) if self.padded else None

    @property
    def canonical_layers(self) -> bool:
        """Whether the stored layer order is the canonical one (no circular pipeline)."""
        return self.layer_order == tuple(range(len(self.layer_order)))

    @property
    def degrees(self) -> Degrees:
        """Every parallel degree of the plan's mesh, one name for each meaning."""
        return Degrees.of(self.mesh.shape)

    @property
    def num_devices(self) -> int:
        return self.degrees.devices

    @property
    def microbatches(self) -> int:
        """Microbatches a step runs: the pipeline's, or those accumulated one after another."""
        return self.schedule.microbatches if self.schedule else self.accum_steps

    @property
    def rows_per_microbatch(self) -> int:
        """Sequences of one microbatch on one device."""
        return self.cfg.train.global_batch // self.microbatches // self.degrees.batch

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens of one microbatch on one device (its rows, their share of the sequence)."""
        return self.rows_per_microbatch * self.cfg.train.seq_len // self.degrees.seq

    @property
    def layers_per_stage(self) -> int:
        """Layer slots stored on one device (padding slots included): all of them without a
        pipeline, a stage's with one."""
        return len(self.layer_order) // (self.schedule.stages if self.schedule else 1)

    @property
    def layers_per_chunk(self) -> int:
        """Layers one pass over a device's stack runs: a chunk of a circular pipeline's stage,
        else all its layers."""
        return self.layers_per_stage // (self.schedule.repeats if self.schedule else 1)

    @property
    def peak_dtype(self) -> str:
        """The peak FLOP/s that MFU is taken against: float8's where the projections run FP8
        GEMMs (`model.fp8`, not emulated), else the compute dtype's."""
        m = self.cfg.model
        return FP8_PEAK if m.fp8 != "off" and not m.fp8_emulate else m.dtype

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step trains on (the global batch's sequences times their length)."""
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    def sharding(self, names):
        """The NamedSharding of an activation with logical `names` under the compute rules."""
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, self.rules.compute.spec(names))

    @property
    def batch_sharding(self):
        """tokens[B, T+1]: rows over the batch axis."""
        return self.sharding(("batch", None))

    def param_specs(self) -> dict:
        """{parameter key: PartitionSpec as stored}, from the parameters' logical names."""
        from flax import nnx

        from ..model import abstract_model
        from ..store import flat

        _, params = abstract_model(self.cfg.model, self.layer_order)
        variables = flat(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return {k: self.rules.params.spec(v.get_metadata("axes")) for k, v in variables.items()}

    def describe(self) -> str:
        """The layout in a few lines: mesh, ZeRO, SP, remat and the pipeline schedule."""
        par = self.cfg.parallel
        sharded = self.rules.grads_over_batch and par.zero_stage < 2  # ZeRO-1 accumulating
        m = self.cfg.mesh
        experts = (f" (the data devices as data {self.degrees.replicas} x expert "
                   f"{m.expert}: the experts split {m.expert} ways)" if m.expert > 1 else "")
        deg = self.degrees
        hsdp = (f" over groups of {deg.zero} ({deg.replicate} copies: HSDP)"
                if deg.replicate > 1 and par.zero_stage else "")
        lines = [f"mesh {dict(self.mesh.shape)}{experts}, ZeRO-{par.zero_stage}{hsdp}"
                 f"{' (gradients accumulated sharded)' if sharded else ''}, "
                 f"SP {par.sequence_parallel}, remat {par.remat}, attention {self.attention}"
                 + (f" (each device's heads over the whole sequence: {self.attention_local})"
                    if self.attention == "ulysses" else "")]
        if self.experts:
            kernel, warning = self.experts
            how = ("fixed buffers of capacity factor "
                   f"{self.cfg.model.capacity_factor:g}, over capacity dropped"
                   if kernel == "capacity" else
                   f"dropless, weight gradient {self.cfg.model.expert_weight_grad}")
            lines.append(f"experts: {kernel} ({how}){'; ' + warning if warning else ''}")
        if self.eot is not None:
            why = self.attention_fallback
            dense = (", given to cuDNN as a dense T x T mask (its jax call takes no document "
                     f"ids){'; warning: pallas ' + why if why else ''}"
                     if self.attention_local == "cudnn" else "")
            lines.append(f"documents: each attends to itself alone (end of text: id {self.eot})"
                         f"{dense}")
        if self.cfg.model.fp8 != "off":
            m = self.cfg.model
            lines.append(f"fp8: the projections' GEMMs in e4m3 (e5m2 gradients), scales from "
                         f"{m.fp8_history} steps of amax history"
                         + (f"; emulated: the GEMMs run in {m.dtype}" if m.fp8_emulate else ""))
        if self.schedule:
            lines.append(self.schedule.describe(self.layer_order))
        elif self.accum_steps > 1:
            lines.append(f"gradient accumulation over {self.accum_steps} microbatches")
        return "\n".join(lines)

