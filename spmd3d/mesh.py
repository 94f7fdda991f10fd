"""The one device mesh: axis names, hardware topologies and mesh construction.

The four mesh axis names are spelled here and nowhere else (the rules table in `sharding.py`
imports them). Axis order is outermost-first: `data` and `stage` vary slowest, so they span
nodes; `tensor` and `seq` vary fastest, so neighbouring devices, the ones on NVLink, share them.

Expert parallelism (an MoE model with `mesh.expert` > 1) builds the data-parallel devices as
two axes, `data` x `expert`: the batch is split over both (dense layers see one data-parallel
group, as before), the experts over `expert` alone. A dense mesh has no `expert` axis.

HSDP (`mesh.replicate` > 1) carves one more axis out of the data-parallel devices, outermost:
`replicate` x `data` (x `expert`). The batch is split over all of them, ZeRO shards over
`data` (and `expert`) alone, so each group of `data` devices (a node's) holds one whole copy
of the sharded state and the copies are reduced across nodes as plain data parallelism.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

DATA, STAGE, TENSOR, SEQ = AXES = ("data", "stage", "tensor", "seq")
EXPERT = "expert"
REPLICATE = "replicate"


def axis_names(sizes: dict) -> tuple:
    """The mesh's axes for `sizes` (MeshConfig.sizes()): AXES, with EXPERT after `stage` (nearer
    the fast links than `stage`: its collectives run every MoE layer) and REPLICATE first (the
    slowest: across nodes) when they are there."""
    names = AXES[:2] + (EXPERT,) + AXES[2:] if EXPERT in sizes else AXES
    return (REPLICATE,) + names if REPLICATE in sizes else names


@dataclass(frozen=True)
class Degrees:
    """Every parallel degree of a mesh, one name for each meaning (torchtitan's `ParallelDims`),
    and the counts that follow from them. Modules read these, not axis sizes by name.

    `replicas` is the mesh's `data` axis: under expert parallelism the copies of each expert
    shard, else the data-parallel devices of a ZeRO group. `replicate` is HSDP's copies of the
    whole ZeRO group (1 without HSDP). The batch is split over `batch` = replicate x replicas
    x expert devices: the config's `mesh.data`. ZeRO shards over `zero` = replicas x expert."""

    replicas: int = 1
    expert: int = 1
    stage: int = 1
    tensor: int = 1
    seq: int = 1
    replicate: int = 1

    @classmethod
    def of(cls, shape) -> "Degrees":
        """The degrees of a mesh's axis sizes (`mesh.shape`, `MeshConfig.sizes()`, a report's
        mesh)."""
        return cls(shape[DATA], shape.get(EXPERT, 1), shape[STAGE], shape[TENSOR], shape[SEQ],
                   shape.get(REPLICATE, 1))

    @property
    def batch(self) -> int:
        """Devices that split the batch: replicate x replicas x expert."""
        return self.replicate * self.replicas * self.expert

    @property
    def zero(self) -> int:
        """Devices ZeRO shards the state over: a group's, replicas x expert."""
        return self.replicas * self.expert

    @property
    def devices(self) -> int:
        return self.batch * self.stage * self.tensor * self.seq

    def sizes(self) -> dict[str, int]:
        """Mesh axis sizes in the mesh's order (`axis_names`); `expert` and `replicate` only
        when they split."""
        sizes = {DATA: self.replicas, STAGE: self.stage, TENSOR: self.tensor, SEQ: self.seq}
        if self.expert > 1:
            sizes[EXPERT] = self.expert
        if self.replicate > 1:
            sizes[REPLICATE] = self.replicate
        return {a: sizes[a] for a in axis_names(sizes)}


MESH_DIR = Path(__file__).resolve().parent / "meshes"  # top-level meshes/ links here


# Dense tensor-core peak TFLOP/s per GPU by `device_kind` (what jax reports, lower-cased,
# matched by the first pattern it contains), from NVIDIA's data sheets; float32 is TF32, which
# XLA uses for float32 matmuls on these GPUs; float8 (e4m3/e5m2 GEMMs, Hopper on) is what
# `model.fp8` runs its projections at. SXM parts; H200 has H100 SXM's compute.
FP8_PEAK = "float8"
DEVICE_PEAK_TFLOPS = (
    ("gh200", {"float32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),
    ("h200", {"float32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),
    ("h100 pcie", {"float32": 378.0, "bfloat16": 756.0, "float16": 756.0, "float8": 1513.0}),
    ("h100 nvl", {"float32": 417.5, "bfloat16": 835.0, "float16": 835.0, "float8": 1670.5}),
    ("h100", {"float32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),
    ("a100", {"float32": 156.0, "bfloat16": 312.0, "float16": 312.0}),
)


def device_peak_tflops(device_kind: str) -> dict | None:
    """{dtype: peak TFLOP/s} of one device of `device_kind` (e.g. "NVIDIA H100 80GB HBM3"),
    or None for a kind not in DEVICE_PEAK_TFLOPS (a CPU, say)."""
    kind = device_kind.lower()
    return next((peaks for pattern, peaks in DEVICE_PEAK_TFLOPS if pattern in kind), None)


@dataclass(frozen=True)
class Topology:
    """What the hardware is: nodes of devices, link speeds, device memory and peak FLOP/s."""

    name: str
    platform: str
    devices_per_node: int
    nodes: int
    intra_node_gbps: float
    inter_node_gbps: float
    device_memory_gb: float
    # ((dtype, TFLOP/s), ...) per device; per host when the devices are simulated on shared
    # cores. A tuple of pairs, not a dict, so that a Topology (and a Plan holding it) hashes.
    peak_tflops: tuple
    simulated: bool = False  # devices are XLA:CPU host devices sharing one machine's cores
    # The planner's step-time assumptions (`plan/estimate.py`), with defaults for a well-tuned
    # GPU run; `plan --calibrate` takes them from a measured run instead.
    matmul_efficiency: float = 0.7  # achieved share of peak FLOP/s in the layers' matmuls
    attention_efficiency: float = 0.5  # ... in attention's score and value products
    link_efficiency: float = 0.8  # achieved share of a link's bandwidth by a collective
    # mesh axes whose collectives hide behind compute: the gradients' reductions and ZeRO's
    # gathers, inside a ZeRO group and (HSDP) across them
    overlapped: tuple = ("data", "replicate")
    host_gbps: float = 50.0  # a device's link to its host's memory (PCIe 5 x16), each way

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def peak_flops(self, dtype: str, num_devices: int = 1, device_kind: str = "") -> float:
        """Peak FLOP/s of `num_devices` devices for a compute dtype name: the device kind's
        own (DEVICE_PEAK_TFLOPS) when it is known, else the topology's. Simulated CPU devices
        share the host's cores, so together they never exceed the host's peak."""
        peaks = (None if self.simulated else device_peak_tflops(device_kind)) or dict(self.peak_tflops)
        per = float(peaks.get(dtype, peaks["float32"])) * 1e12
        return per if self.simulated else per * num_devices


def load_topology(name: str, platform: str = "cpu") -> Topology:
    """`meshes/NAME.yaml` (shipped with the package) or a path to a `.yaml`; `auto` picks
    `cpu` on CPU and `h100x8` on GPU."""
    from .config import ConfigError

    if name == "auto":
        name = "cpu" if platform == "cpu" else "h100x8"
    path = Path(name).expanduser() if name.endswith(".yaml") else MESH_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MESH_DIR.glob("*.yaml")))
        raise ConfigError("mesh.topology", f"no topology {name!r} in meshes/ (known: {known})")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError("mesh.topology", f"cannot read {path} ({str(e).splitlines()[0]})") from None
    fields = {f.name: f for f in dataclasses.fields(Topology)}
    if not isinstance(data, dict):
        raise ConfigError("mesh.topology", f"{path.name} must hold a mapping of fields")
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data]
    unknown = [n for n in data if n not in fields]
    if missing or unknown:
        raise ConfigError("mesh.topology", f"{path.name}: " + "; ".join(
            ([f"lacks {', '.join(missing)}"] if missing else [])
            + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or "float32" not in peaks:
        raise ConfigError("mesh.topology", f"{path.name}: peak_tflops must map dtypes to "
                                           "TFLOP/s, float32 among them")
    try:
        return Topology(**{**data, "peak_tflops": tuple(sorted(peaks.items())),
                           "overlapped": tuple(data.get("overlapped", Topology.overlapped))})
    except (TypeError, AttributeError) as e:
        raise ConfigError("mesh.topology", f"{path.name}: {e}") from None


def simulate_devices(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices. Must run before jax is imported to take effect.

    n > 0 also pins JAX to the CPU; n == -1 asks for 8 CPU devices but lets JAX pick an
    accelerator when one is present (the host-device flag only affects the CPU platform).
    """
    if n == 0:
        return
    count = 8 if n == -1 else n
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if n > 0:
        os.environ["JAX_PLATFORMS"] = "cpu"


def simulate(n: int = 8) -> int:
    """Run on `n` simulated CPU devices (XLA host devices). Call it before jax starts its
    backends (in a notebook: the first cell); calling it again with the same `n` is harmless.
    Returns `n`."""
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            from jax._src.xla_bridge import backends_are_initialized
        except ImportError:  # cannot tell: assume started, and check the devices it has
            backends_are_initialized = lambda: True  # noqa: E731
        if backends_are_initialized():
            have = jax.devices()
            if len(have) == n and have[0].platform == "cpu":
                return n
            raise RuntimeError(
                f"jax already runs on {len(have)} {have[0].platform} device(s); simulate({n}) "
                "must come before the first use of jax (restart the kernel and call it first)")
    simulate_devices(n)
    if jax is not None:  # imported but not started: its platform choice was read at import
        jax.config.update("jax_platforms", "cpu")
    return n


def split_over_hosts(sizes: dict, per_host: int, hosts: int, allow_cross_host: bool = False,
                     inside: str = SEQ) -> tuple[list[int], list[int]]:
    """(sizes inside a host, sizes across hosts), both in AXES order, for `hosts` hosts of
    `per_host` devices each.

    A host is filled fastest-axis first (seq, tensor, stage, data; with `inside` = tensor,
    tensor before seq), so `tensor` and `seq`, which communicate every layer, stay on the
    fast intra-host links and `stage`/`data` take whatever must cross hosts. A layout that
    still puts `tensor` across hosts, or `seq` unless `inside` is tensor (the ring across
    nodes, which long context asks for), raises ConfigError unless `allow_cross_host`: it
    runs, but every layer would wait on the slow inter-host network.
    """
    from .config import ConfigError

    names = axis_names(sizes)
    total = int(np.prod([sizes[a] for a in names]))
    if total != per_host * hosts:
        raise ConfigError("mesh", f"data*stage*tensor*seq = {total} but there are {hosts} "
                                  f"hosts of {per_host} devices")
    inner, room = {}, per_host
    order = list(reversed(names))  # seq, tensor, (expert,) stage, data
    if inside == TENSOR:
        order.remove(TENSOR)
        order.insert(0, TENSOR)
    for a in order:
        inner[a] = int(np.gcd(sizes[a], room))
        room //= inner[a]
    # room always ends at 1 (each gcd takes every factor the axis can give, and the product
    # holds all of per_host's): each host gets one whole block of the mesh
    outer = {a: sizes[a] // inner[a] for a in names}
    for a in (TENSOR, SEQ):
        if outer[a] > 1 and not allow_cross_host and not (a == SEQ and inside == TENSOR):
            inside = " x ".join(f"{b} {inner[b]}" for b in names if inner[b] > 1) or "nothing"
            raise ConfigError(f"mesh.{a}", (
                f"{a} = {sizes[a]} would span {outer[a]} hosts (a host has {per_host} devices, "
                f"holding {inside}); {a} talks every layer and needs the fast links inside a "
                f"host: lower mesh.{a}"
                + (", set mesh.inside=tensor to keep tensor inside and let seq span hosts,"
                   if a == TENSOR and sizes[TENSOR] <= per_host else ",")
                + " or set mesh.allow_cross_host=true to run it anyway"))
    return [inner[a] for a in names], [outer[a] for a in names]


def make_mesh(sizes: dict, devices=None, allow_cross_host: bool = False, inside: str = SEQ):
    """A `jax.sharding.Mesh` over AXES with Auto axis types (GSPMD/Shardy propagation).

    With several processes (hosts) the device order is hybrid: each host's devices fill
    `seq`, `tensor` (`inside` first), then `stage`/`data`, so the fast axes never cross a
    host (`split_over_hosts`; ConfigError if they would, unless `allow_cross_host`).
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    names = axis_names(sizes)
    shape = [sizes[a] for a in names]
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh {sizes} needs {int(np.prod(shape))} devices, got {len(devices)}")
    hosts = len({d.process_index for d in devices})
    if hosts > 1:
        inner, outer = split_over_hosts(sizes, len(devices) // hosts, hosts, allow_cross_host,
                                        inside)
        grid = mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=True)
    else:
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def abstract_mesh(sizes: dict):
    """The mesh's shape and axis names without devices (`jax.sharding.AbstractMesh`): enough to
    derive every sharding and to trace, for planning a layout larger than this machine."""
    from jax.sharding import AbstractMesh, AxisType

    names = axis_names(sizes)
    return AbstractMesh(tuple(sizes[a] for a in names), names,
                        axis_types=(AxisType.Auto,) * len(names))
