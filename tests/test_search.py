"""`plan --search` and `plan --calibrate`: every fitting layout ranked, none lost to pruning,
the published layouts found; bad input is one line and exit status 2."""

import dataclasses
import itertools
import json

import pytest
import yaml

from spmd3d import config
from spmd3d.mesh import MESH_DIR, load_topology
from spmd3d.plan import estimate, search
from spmd3d.plan.__main__ import main
from spmd3d.plan.calibrate import calibrate

# one worker: the searches of MODEL trace its layer once per distinct shard (`residuals.of`'s
# cache), not once in each worker
pytestmark = pytest.mark.xdist_group("search")

# a 1B-sized model whose layouts on 8 devices do not all fit in a 4 GB device
MODEL = ["model.num_layers=8", "model.d_model=2048", "model.num_heads=16", "model.num_kv_heads=8",
         "model.d_ff=5632", "model.vocab_size=32000", "model.dtype=bfloat16",
         "train.seq_len=2048", "train.global_batch=16", "mesh.simulated_devices=0"]


def topology_file(tmp_path, **changes) -> str:
    """A copy of h100x8 with some fields changed (None: removed), as a YAML path."""
    data = yaml.safe_load((MESH_DIR / "h100x8.yaml").read_text())
    data.update({k: v for k, v in changes.items() if v is not None})
    for k in [k for k, v in changes.items() if v is None]:
        del data[k]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def small():
    """(config, topology of 4 GB devices, the search's result)."""
    cfg = config.load(None, MODEL + ["mesh.data=8", "mesh.tensor=1"])
    topology = dataclasses.replace(load_topology("h100x8"), device_memory_gb=4.0)
    return cfg, topology, search.search(cfg, topology, 8)


def test_search_ranks_the_fastest_fitting_zero_stage_of_every_layout(small):
    """Against brute force: every layout of the 8 devices (the ring and Ulysses where the
    sequence is split; each ZeRO stage estimated on its
    own) that fits is in the table through the fastest of its ZeRO stages that fit, with that
    stage's estimate; none that does not fit is; fastest first."""
    cfg, topology, found = small
    ranked, limit = found["ranked"], search.FIT * 4e9
    assert ranked and len(ranked) < found["valid"]  # the memory limit bites
    times = [c.step_s for c in ranked]
    assert times == sorted(times)
    best = {}
    for mesh in search.meshes(cfg, 8, 8):
        for (kind, v, micro), sp, remat, zero, context in itertools.product(
                search.pipelines(cfg, mesh), (False, True), search.REMATS, range(4),
                ("ring", "ulysses")):
            if (sp and mesh["tensor"] == 1) or (context == "ulysses" and mesh["seq"] == 1):
                continue
            layout = search._layout(cfg, mesh, kind, v, micro, sp, zero, remat, context)
            try:
                c = search.evaluate(layout, topology)
            except config.ConfigError:
                continue
            key = c.key()[:1] + c.key()[2:]  # the layout but its ZeRO stage
            if c.needed <= limit and (key not in best or c.step_s < best[key].step_s):
                best[key] = c
    assert {c.key() for c in ranked} == {c.key() for c in best.values()}
    for c in ranked:  # each one's figures are its own plan's
        assert c.estimate == estimate.estimate(search.evaluate(c.plan.cfg, topology).plan)


def test_search_lays_out_the_experts_too():
    """An MoE model's search also varies the expert-parallel degree: every degree that
    divides data and the expert count is tried, the table says which each layout has, and
    each ranked layout's figures are its own plan's."""
    cfg = config.load(None, MODEL + ["mesh.data=4", "mesh.tensor=1", "model.num_experts=4",
                                     "model.experts_per_token=2", "model.d_ff_expert=1408"])
    topology = dataclasses.replace(load_topology("h100x8"), device_memory_gb=16.0)
    meshes = list(search.meshes(cfg, 8, 4))
    assert {(m["data"], m["expert"]) for m in meshes if m["data"] == 4} == {
        (4, 1), (4, 2), (4, 4)}
    lines, record, ranked = search.run(cfg, topology, 2, 5, None)  # 2 devices: a short search
    assert {c.plan.cfg.mesh.expert for c in ranked} == {1, 2}
    assert "expert" in lines[1] and [r["mesh"]["expert"] for r in record["top"]] == [
        c.plan.cfg.mesh.expert for c in ranked[:5]]
    for c in ranked[:5]:
        assert c.estimate == estimate.estimate(search.evaluate(c.plan.cfg, topology).plan)


def test_the_published_layouts_fit_and_are_ranked():
    """LLaMA-3 405B on 16,384 H100s: Meta's TP8 PP16 DP128 (16 sequences of 8192 tokens per
    data shard) is among the layouts that fit; the search's first is no slower."""
    cfg = config.load("llama3_405b", ["mesh.topology=h100_16k", "mesh.data=128",
                                      "train.global_batch=2048", "train.microbatches=16",
                                      "parallel.pipeline_schedule=1f1b",
                                      "parallel.pipeline_repeats=2", "parallel.remat=full",
                                      "parallel.zero_stage=1"])
    topology = load_topology("h100_16k")
    lines, record, ranked = search.run(cfg, topology, 16384, 10,
                                       search.evaluate(cfg, topology))
    own = record["config_layout"]
    assert own["mesh"] == {"data": 128, "stage": 16, "tensor": 8, "seq": 1}
    assert own["rank"] is not None and ranked[0].step_s <= own["step_s"]
    assert len(record["top"]) == 10 and record["fitting"] == len(ranked)
    assert all(c.needed <= search.FIT * 80e9 for c in ranked)


def test_search_cli_json_and_compile_top(capsys):
    """The table, the config's own layout ranked, and the first layout compiled: its compiled
    memory beside the analytic, within what the memory model is known to miss."""
    argv = MODEL + ["mesh.data=8", "mesh.tensor=1", "--search", "--top=3", "--compile-top=1"]
    assert main(argv + ["--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])["search"]
    assert len(r["top"]) == 3 and r["fitting"] >= 3 and r["config_layout"]["rank"] >= 1
    assert any(line.startswith("rank") for line in out)
    compiled = r["top"][0]["compiled_needed_gb"]
    assert "compiled_needed_gb" not in r["top"][1]
    assert 0.5 < r["top"][0]["needed_gb"] / compiled < 1.5


def test_search_lays_out_the_configs_own_device_count(capsys):
    """Without --devices, the config's own device count (4 of the topology's 8): the whole
    topology is what --devices=8 asks for."""
    argv = MODEL + ["mesh.data=4", "mesh.tensor=1", "--search", "--top=1", "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["search"]
    assert r["devices"] == 4 and r["config_layout"]["mesh"]
    assert main(argv + ["--devices=8"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["search"]
    assert r["devices"] == 8 and "config_layout" not in r


@pytest.mark.parametrize("argv,field,says", [
    (["--search", "--devices=9"], "--devices", "at most 8 devices"),
    (["--search", "mesh.topology=dgx_h100_64", "--devices=12"], "--devices", "whole nodes"),
])
def test_impossible_device_counts_exit_2(capsys, argv, field, says):
    assert main(MODEL + ["mesh.data=8", "mesh.tensor=1"] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: ") and says in err[0]


def test_a_topology_without_its_fields_exits_2(capsys, tmp_path):
    path = topology_file(tmp_path, device_memory_gb=None, peak_tflops=None)
    assert main(MODEL + ["mesh.data=8", "mesh.tensor=1", f"mesh.topology={path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: mesh.topology: cluster.yaml: lacks device_memory_gb, peak_tflops"]


def test_a_layout_that_fits_nowhere_exits_2(capsys, tmp_path):
    """0.1 GB devices: no layout fits (the search says what the smallest needs), and the
    config's own layout is reported, then refused. On 2 devices: a search of 8 traces the
    layer at every shard 8 devices give it (30 s), which `make test-slow`'s searches do."""
    path = topology_file(tmp_path, device_memory_gb=0.1)
    argv = MODEL + ["mesh.data=2", "mesh.tensor=1", f"mesh.topology={path}"]
    assert main(argv + ["--search"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --search: no layout of this model on 2 "
                                               "devices fits in 0 GB")
    assert "the smallest needs" in err[0]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "analytic, per device (GB)" in captured.out  # the report first
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: mesh: this layout needs")


def bench_record(cfg, devices: int, seconds: float, kind="NVIDIA H100 80GB HBM3") -> dict:
    return {"config": "x", "cfg": config.to_dict(cfg), "devices": devices, "device_kind": kind,
            "peak_tflops": 989.4 * devices, "step_time_median_s": seconds}


def test_calibrate_makes_the_prediction_the_measurement(tmp_path):
    """A run measured twice as slow as predicted halves both compute efficiencies, after which
    the planner predicts the measured time; a CPU run or a record without its config is
    refused."""
    cfg = config.load(None, MODEL + ["mesh.data=8", "mesh.tensor=1"])
    topology = load_topology("h100x8")
    predicted = search.evaluate(cfg, topology).estimate["time"]
    assert predicted["exposed_comm_s"] == 0  # data's reduction hides behind compute
    path = tmp_path / "bench.json"
    path.write_text("bench x ...\n" + json.dumps(bench_record(cfg, 8, 2 * predicted["step_s"])))
    calibrated, record, note = calibrate(str(path), topology)
    assert calibrated.matmul_efficiency == pytest.approx(topology.matmul_efficiency / 2)
    assert calibrated.attention_efficiency == pytest.approx(topology.attention_efficiency / 2)
    again = search.evaluate(cfg, calibrated).estimate["time"]["step_s"]
    assert again == pytest.approx(2 * predicted["step_s"], rel=1e-9)
    assert record["factor"] == pytest.approx(0.5) and "matmul_efficiency 0.70 -> 0.350" in note
    path.write_text(json.dumps(bench_record(cfg, 8, 1.0, kind="cpu")))
    with pytest.raises(config.ConfigError, match="CPU devices"):
        calibrate(str(path), topology)
    path.write_text(json.dumps({"step_time_median_s": 1.0}))
    with pytest.raises(config.ConfigError, match="lacks cfg, devices, peak_tflops"):
        calibrate(str(path), topology)


def test_long_context_meshes_may_run_the_ring_across_nodes():
    """At long context the search also lays tensor inside a node and seq across nodes
    (`mesh.inside=tensor`), never with a device's share of a sequence below
    ACROSS_MIN_TOKENS, and never tensor itself across nodes."""
    def across(seq_len):
        cfg = config.load(None, MODEL + ["mesh.data=8", "mesh.tensor=1",
                                         f"train.seq_len={seq_len}"])
        return [m for m in search.meshes(cfg, 4, 64) if m["tensor"] * m["seq"] > 4]

    long = across(131072)
    assert long and all(m["inside"] == "tensor" and 4 % m["tensor"] == 0 for m in long)
    assert all(131072 // m["seq"] >= search.ACROSS_MIN_TOKENS for m in long)
    assert across(4096) == []
