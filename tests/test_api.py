"""The Python API gives the command line's numbers, tables and checkpoints, piece by piece.

Three experiments are compiled once per module and shared: one device, DP 8, and TP 4 x
ZeRO-3 over data 2 (the last one also receives the DP checkpoint, so it runs last).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import spmd3d
from helpers import SMALL, env_without_devices, max_rel_diff
from spmd3d.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
L = 2  # model.num_layers in SMALL


def cfg(data=1, stage=1, tensor=1, seq=1, **sections):
    return spmd3d.configure(None, SMALL + [f"train.steps={STEPS}", "parallel.zero_stage=0"],
                            mesh=dict(data=data, stage=stage, tensor=tensor, seq=seq), **sections)


def trained(c):
    exp = spmd3d.Experiment(c)
    exp.run(STEPS)
    return exp


@pytest.fixture(scope="module")
def one():
    return trained(cfg())


@pytest.fixture(scope="module")
def dp():
    return trained(cfg(data=8))


@pytest.fixture(scope="module")
def tp():
    return spmd3d.Experiment(cfg(data=2, tensor=4, parallel=dict(zero_stage=3)))


def clean_env():
    """This interpreter's environment without the simulated-device flags conftest sets."""
    env = env_without_devices(platform=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_import_does_not_start_jax():
    code = ("import sys, spmd3d\n"
            "c = spmd3d.configure('demo', ['train.steps=5'], mesh=dict(data=4))\n"
            "assert c.mesh.data == 4 and spmd3d.Experiment.__name__ == 'Experiment'\n"
            "assert 'jax' not in sys.modules, 'import spmd3d imported jax'\n")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_simulate_after_jax_started():
    import jax

    assert len(jax.devices()) == 8  # conftest's 8 devices are up: same count is a no-op
    assert spmd3d.simulate(8) == 8
    with pytest.raises(RuntimeError, match="before the first use of jax"):
        spmd3d.simulate(4)


def test_configure_presets_and_overrides():
    by_string = spmd3d.configure("demo", ["mesh.data=4", "optim.lr=1e-3"])
    by_section = spmd3d.configure("demo", mesh=dict(data=4), optim=dict(lr=1e-3))
    by_dotted = spmd3d.configure(str(ROOT / "configs" / "demo.yaml"),
                                 **{"mesh.data": 4, "optim.lr": 1e-3})
    assert by_string == by_section == by_dotted
    assert spmd3d.configure("bench_small").model.d_ff == 1024
    with pytest.raises(ConfigError, match="model.num_kv_heads"):
        spmd3d.configure("demo", mesh=dict(tensor=4))  # 2 kv heads cannot split 4 ways
    with pytest.raises(ConfigError, match="no preset or file"):
        spmd3d.configure("no_such_preset")


def test_data_parallel_losses_equal_one_device(one, dp):
    assert one.mesh.size == 1 and dp.mesh.size == 8
    first, records = one.history[:STEPS], dp.history[:STEPS]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"} <= records[0].keys()
    got, want = [r["loss"] for r in records], [r["loss"] for r in first]
    assert max_rel_diff(got, want) < 1e-4, (got, want)
    assert got[-1] < got[0]


def test_an_expert_axis_takes_its_devices_and_equals_one_device():
    """`mesh.data` counts the expert-parallel devices too: data 4 (experts split 4 ways) x
    tensor 2 is 8 devices (it was taken as 2), and trains to one device's losses."""
    moe = ["model.num_experts=8", "model.experts_per_token=2", "model.d_ff_expert=64"]

    def moe_cfg(**mesh):
        return spmd3d.configure(None, SMALL + [f"train.steps={STEPS}", *moe],
                                mesh=dict(stage=1, seq=1, **mesh))

    split = trained(moe_cfg(data=4, expert=4, tensor=2))
    assert split.mesh.size == 8
    assert dict(split.mesh.shape) == {"data": 1, "expert": 4, "stage": 1, "tensor": 2, "seq": 1}
    alone = trained(moe_cfg(data=1, expert=1, tensor=1))
    got, want = ([r["loss"] for r in e.history[:STEPS]] for e in (split, alone))
    assert max_rel_diff(got, want) < 1e-4, (got, want)


def test_params_table_matches_rules_and_the_state(tp):
    rows = tp.params_table()
    assert "blocks/mlp/w_down" in repr(rows)  # prints as a table
    rules, mesh = tp.rules, tp.mesh
    for row in rows:
        assert row["stored"] == tuple(rules.params.spec(row["logical"]))
        assert row["opt_state"] == tuple(rules.opt.spec(row["logical"]))
        # the array that actually results is laid out as the table says
        arr = tp.param(row["param"])
        assert arr.shape == row["shape"]
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, P(*row["stored"])), arr.ndim)
        assert arr.addressable_shards[0].data.shape == row["local_shape"]
    down = next(r for r in rows if r["param"] == "blocks/mlp/w_down")
    assert down["stored"] == ("stage", "tensor", "data")  # ZeRO-3: embed over data
    assert down["local_shape"] == (L, 256 // 4, 128 // 2)


def argument_bytes(exp) -> int:
    """Per-device bytes of the step's arguments by the plan: the state's shards and the batch's."""
    import jax

    leaves = zip(jax.tree.leaves(exp.job.abstract), jax.tree.leaves(exp.job.shardings))
    state = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize for a, s in leaves)
    t = exp.cfg.train
    return state + t.global_batch // exp.cfg.mesh.data * (t.seq_len + 1) * 4


def test_memory_and_collectives_tell_layouts_apart(dp, tp):
    mem_dp, mem_tp = dp.memory(), tp.memory()
    assert all(mem_dp[k] > 0 for k in ("argument_bytes", "output_bytes", "temp_bytes"))
    assert mem_dp["argument_bytes"] == argument_bytes(dp)
    assert mem_tp["argument_bytes"] == argument_bytes(tp)
    # TP 4 x ZeRO-3 over 2 stores an eighth of the parameters and optimizer state per device
    # (the norm scales stay whole)
    assert mem_dp["argument_bytes"] / 8 < mem_tp["argument_bytes"] < mem_dp["argument_bytes"] / 7

    def counts(exp):
        return {(r["kind"], r["axes"]): r["count"] for r in exp.collectives()}

    c_dp, c_tp = counts(dp), counts(tp)
    # DP: each layer's gradients all-reduced over data once, inside the backward layer loop,
    # and one all-reduce (combined by XLA) for the embedding, head and final norm
    assert c_dp == {("all-reduce", "data"): L + 1}
    # TP: Megatron's all-reduces over tensor, 2 forward + 2 backward per layer, and 6 outside
    # the layer loop (the vocab-parallel embedding and softmax statistics among them);
    # ZeRO-3: every layer's 4 weights gathered over data in the forward and again in the
    # backward (never kept for it), and the embedding and the head once each outside it (the
    # head as gathered serves its backward too)
    assert c_tp[("all-reduce", "tensor")] == 4 * L + 6
    assert c_tp[("all-gather", "data")] == 8 * L + 2

    table = spmd3d.compare({"DP": dp, "TP": tp})
    assert [r["layout"] for r in table] == ["DP", "TP"]
    assert table[0]["total MiB"] == mem_dp["total_bytes"] / 2**20
    assert "tensor" in table.columns and "tensor" not in table[0] and "ar" in table[1]["tensor"]


def test_save_and_restore_onto_other_meshes(dp, tp, tmp_path):
    run = dp.save(tmp_path / "run")
    assert (run / "config.yaml").is_file()
    saved = dp.canonical_params()

    restored = spmd3d.restore(tp, run)  # onto TP x ZeRO-3, reusing its compiled step
    assert restored is tp and tp.step == STEPS
    for k, v in tp.canonical_params().items():
        assert np.array_equal(v, saved[k]), k
    # and training goes on with the same loss
    nxt_dp, nxt_tp = dp.run(1)[0], tp.run(1)[0]
    assert nxt_dp["step"] == nxt_tp["step"] == STEPS + 1
    assert max_rel_diff([nxt_tp["loss"]], [nxt_dp["loss"]]) < 1e-4

    # onto a pipeline, from a config (no step compiled)
    pp = spmd3d.restore(cfg(stage=2, tensor=4), run)
    assert pp.mesh.shape["stage"] == 2 and pp.step == STEPS
    for k, v in pp.canonical_params().items():
        assert np.array_equal(v, saved[k]), k
    # a sample of the restored parameters, made as a training run makes them (tensor 4)
    text = pp.sample("def ", 5)
    assert text.startswith("def ") and len(text.encode()) >= len("def ") + 1

    with pytest.raises(FileNotFoundError):
        spmd3d.restore(tp, tmp_path / "empty")


def readme_snippet() -> str:
    readme = ROOT / "README.md"
    m = re.search(r"<!-- api-snippet -->\s*```python\n(.*?)```\s*<!-- /api-snippet -->",
                  readme.read_text(), re.S)
    assert m, f"{readme} has no ```python block between <!-- api-snippet --> markers"
    return m.group(1)


def test_readme_api_snippet_runs(tmp_path):
    """The README's snippet, as a user would run it: a fresh interpreter, no device flags."""
    out = subprocess.run([sys.executable, "-c", readme_snippet()], cwd=tmp_path, env=clean_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "blocks/mlp/w_down" in out.stdout and "all-reduce" in out.stdout
    assert (tmp_path / "runs" / "api-demo" / "checkpoints").is_dir()
