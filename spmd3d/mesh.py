"""The one device mesh: axis names, hardware topologies and mesh construction.

The four mesh axis names are spelled here and nowhere else (the rules table in `sharding.py`
imports them). Axis order is outermost-first: `data` and `stage` vary slowest, so they span
nodes; `tensor` and `seq` vary fastest, so neighbouring devices, the ones on NVLink, share them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

DATA, STAGE, TENSOR, SEQ = AXES = ("data", "stage", "tensor", "seq")
MESH_DIR = Path(__file__).resolve().parent.parent / "meshes"


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
    peak_tflops: dict  # per device; per host when the devices are simulated on shared cores
    simulated: bool = False  # devices are XLA:CPU host devices sharing one machine's cores

    def peak_flops(self, dtype: str, num_devices: int = 1) -> float:
        """Peak FLOP/s of `num_devices` devices for a compute dtype name. Simulated CPU devices
        share the host's cores, so together they never exceed the host's peak."""
        per = float(self.peak_tflops.get(dtype, self.peak_tflops["float32"])) * 1e12
        return per if self.simulated else per * num_devices


def load_topology(name: str, platform: str = "cpu") -> Topology:
    """`meshes/NAME.yaml`; `auto` picks `cpu` on CPU and `h100x8` on GPU."""
    from .config import ConfigError

    if name == "auto":
        name = "cpu" if platform == "cpu" else "h100x8"
    path = MESH_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MESH_DIR.glob("*.yaml")))
        raise ConfigError("mesh.topology", f"no topology {name!r} in meshes/ (known: {known})")
    data = yaml.safe_load(path.read_text())
    try:
        return Topology(**data)
    except TypeError as e:
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


def _split_over_nodes(sizes: dict, per_node: int) -> tuple[list[int], list[int]]:
    """Split axis sizes into (inside a node, across nodes), filling a node fastest-axis first."""
    inner = {a: 1 for a in AXES}
    room = per_node
    for a in reversed(AXES):  # seq, tensor, stage, data
        k = int(np.gcd(sizes[a], room))
        inner[a], room = k, room // k
    return [inner[a] for a in AXES], [sizes[a] // inner[a] for a in AXES]


def make_mesh(sizes: dict, devices=None):
    """A `jax.sharding.Mesh` over AXES with Auto axis types (GSPMD/Shardy propagation).

    With several processes (hosts) the device order is hybrid: each host's devices fill
    `seq`, `tensor`, then `stage`/`data` first, so the fast axes never cross a host.
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    shape = [sizes[a] for a in AXES]
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh {sizes} needs {int(np.prod(shape))} devices, got {len(devices)}")
    if jax.process_count() > 1:
        inner, outer = _split_over_nodes(sizes, jax.local_device_count())
        grid = mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=True)
    else:
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
