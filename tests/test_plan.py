"""The plan: resolved once, the same with devices or from a topology alone, hashable."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from helpers import devices_for, small_config
from spmd3d import config
from spmd3d.mesh import Degrees, load_topology
from spmd3d.pipeline import Schedule
from spmd3d.plan import Plan

ROOT = Path(__file__).resolve().parent.parent

# a circular pipeline over a ring with tensor and ZeRO-3: every decision the plan makes differs
# from its default
LAYOUT = dict(stage=2, tensor=2, seq=2, zero=3, sp=True, micro=4,
              extra=["model.num_layers=4", "parallel.pipeline_repeats=2"])


def decisions(plan: Plan) -> dict:
    return {"rules": plan.rules, "schedule": plan.schedule, "accum": plan.accum_steps,
            "layers": plan.layer_order, "seq": plan.seq_order, "attention": plan.attention,
            "specs": plan.param_specs(), "cfg": plan.cfg, "mesh": dict(plan.mesh.shape)}


def test_the_degrees_name_each_meaning_once():
    """`mesh.data` counts the devices that split the batch, the mesh's `data` axis the
    replicas beside `expert`: `Plan.degrees` names both, and the counts that follow."""
    moe = ["model.num_experts=4", "model.experts_per_token=2", "mesh.expert=2",
           "model.num_layers=4", "parallel.pipeline_repeats=2"]
    cfg = small_config(data=4, stage=2, micro=4, extra=moe)  # 8 devices, 16 sequences of 32
    plan = Plan.resolve(cfg, devices_for(cfg))
    deg = plan.degrees
    assert (deg.replicas, deg.expert, deg.batch, deg.stage, deg.tensor, deg.seq) == (2, 2, 4, 2, 1, 1)
    assert deg.devices == plan.num_devices == cfg.mesh.num_devices == 8
    assert deg.sizes() == dict(plan.mesh.shape)  # the mesh's axes, in its order
    assert list(deg.sizes()) == ["data", "stage", "expert", "tensor", "seq"]
    assert plan.rows_per_microbatch == 16 // 4 // 4 and plan.tokens_per_microbatch == 32
    assert (plan.layers_per_stage, plan.layers_per_chunk) == (2, 1)  # two chunks of one layer
    assert list(Degrees(seq=2).sizes()) == ["data", "stage", "tensor", "seq"]  # no expert axis


def test_plan_from_a_topology_equals_the_plan_on_devices():
    cfg = small_config(**LAYOUT)
    on_devices = Plan.resolve(cfg, devices_for(cfg))
    planned = Plan.resolve(cfg, topology=on_devices.topology)
    assert isinstance(on_devices.mesh, jax.sharding.Mesh)
    assert isinstance(planned.mesh, jax.sharding.AbstractMesh)
    assert decisions(planned) == decisions(on_devices)
    # what the plan decided, spelled out
    assert on_devices.schedule == Schedule(2, 4, 2) and on_devices.accum_steps == 1
    assert on_devices.layer_order == (0, 2, 1, 3) and on_devices.attention == "ring"
    assert on_devices.seq_order[:8] == tuple(range(8))  # chunk 0 of 4, then chunk 3
    assert on_devices.seq_order[8:16] == tuple(range(24, 32))
    assert planned.param_specs()["blocks/mlp/w_down"] == jax.sharding.PartitionSpec(
        "stage", "tensor", "data")
    # frozen and hashable: a plan can key a cache of compiled functions
    assert hash(planned) == hash(Plan.resolve(cfg, topology=on_devices.topology))


def test_plan_without_a_pipeline_accumulates():
    plan = Plan.resolve(small_config(data=4, tensor=2, micro=2), devices_for(small_config(data=4, tensor=2)))
    assert plan.schedule is None and not plan.pipelined and plan.accum_steps == 2
    assert plan.canonical_layers and plan.seq_order is None and plan.attention == "blocked"


def test_a_plan_checks_the_layout_against_the_cluster():
    topology = load_topology("dgx_h100_64")
    cfg = config.load(str(ROOT / "configs" / "gpt3_175b.yaml"), ["mesh.data=-1"])
    assert Plan.resolve(cfg, topology=topology).cfg.mesh.data == 4  # 512 GPUs / (16 x 8)
    wide = config.load(str(ROOT / "configs" / "gpt3_175b.yaml"),
                       ["mesh.data=4", "mesh.tensor=16", "mesh.stage=8"])
    with pytest.raises(config.ConfigError, match="mesh.tensor"):  # tensor 16 spans two nodes
        Plan.resolve(wide, topology=topology)


@pytest.mark.parametrize("name,topology,data,extra", [
    ("gpt3_175b", "dgx_a100_128", 8, []),
    # Meta's 16M-token batch: 2048 sequences of 8192, 16 per data shard
    ("llama3_405b", "h100_16k", 128, ["train.global_batch=2048", "train.microbatches=16"])])
def test_the_published_clusters_hold_the_published_layouts(name, topology, data, extra):
    """GPT-3 175B on 1024 A100s and LLaMA-3 405B on 16,384 H100s at TP8 PP16: data fills the
    rest of the cluster, and tensor stays inside a node."""
    cfg = config.load(str(ROOT / "configs" / f"{name}.yaml"), ["mesh.data=-1", *extra])
    plan = Plan.resolve(cfg, topology=topology)
    assert plan.cfg.mesh.data == data and plan.num_devices == plan.topology.num_devices


def test_gpt3_layout_planned_in_a_one_device_process():
    """1024 devices of GPT-3 175B's Megatron layout, planned where JAX has one CPU device."""
    code = (
        "import json, jax\n"
        "from spmd3d import config\n"
        "from spmd3d.plan import Plan\n"
        "cfg = config.load('configs/gpt3_175b.yaml')\n"
        "plan = Plan.resolve(cfg, topology=cfg.mesh.topology)\n"
        "specs = plan.param_specs()\n"
        "print(json.dumps({'devices': len(jax.devices()), 'mesh': dict(plan.mesh.shape),\n"
        "  'ticks': plan.schedule.ticks, 'accum': plan.accum_steps,\n"
        "  'w_down': list(specs['blocks/mlp/w_down']), 'embed': list(specs['embed'])}))\n")
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"devices": 1, "mesh": {"data": 8, "stage": 16, "tensor": 8, "seq": 1},
                   "ticks": 192 + 16 - 1, "accum": 1,
                   "w_down": ["stage", "tensor", None], "embed": ["tensor", None]}


def test_compile_beyond_what_cpu_simulates_exits_2(capsys):
    """4096 devices outside the data axis cannot be cut down to 2048: one line, exit 2."""
    from spmd3d.plan.__main__ import main

    argv = ["model.num_layers=64", "model.num_heads=64", "model.num_kv_heads=64",
            "model.d_model=4096", "model.d_ff=8192", "model.vocab_size=512", "mesh.stage=64",
            "mesh.tensor=64", "mesh.data=1", "mesh.allow_cross_host=true",
            "mesh.topology=dgx_h100_128", "train.microbatches=64", "train.global_batch=64",
            "--compile"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: mesh: stage*tensor*seq = 4096 devices alone exceed the 2048 that "
                   "XLA:CPU can simulate for --compile"]


def test_tensor_inside_a_node_runs_the_ring_across_nodes_and_is_priced_so():
    """LLaMA-3 70B at 128k tokens, tensor 8 x seq 8 on nodes of 8: seq first (the default)
    puts tensor across nodes and is refused; `mesh.inside=tensor` plans it, the ring's shifts
    priced on the links between nodes and tensor's on NVLink, and the step is faster than
    the same mesh forced the other way round (`allow_cross_host`). `auto` takes the ring
    there: Ulysses' all-to-alls would cross nodes."""
    from spmd3d.plan import estimate

    root = Path(__file__).resolve().parent.parent
    args = ["train.seq_len=131072", "train.global_batch=16", "mesh.data=1", "mesh.stage=4",
            "mesh.tensor=8", "mesh.seq=8", "train.microbatches=16", "parallel.zero_stage=1",
            "parallel.pipeline_schedule=1f1b", "parallel.remat=full", "parallel.context=auto",
            "mesh.topology=dgx_h100_256"]
    load = lambda *extra: config.load(str(root / "configs" / "llama3_70b.yaml"),  # noqa: E731
                                      args + list(extra))
    with pytest.raises(config.ConfigError, match="mesh.inside=tensor"):
        Plan.resolve(load(), topology="dgx_h100_256")
    inside = Plan.resolve(load("mesh.inside=tensor"), topology="dgx_h100_256")
    across = Plan.resolve(load("mesh.allow_cross_host=true"), topology="dgx_h100_256")
    crosses = estimate._crosses_nodes(inside)
    assert crosses["seq"] and not crosses["tensor"]
    assert inside.attention == "ring" == across.attention
    assert (estimate.estimate(inside)["time"]["step_s"]
            < estimate.estimate(across)["time"]["step_s"])
