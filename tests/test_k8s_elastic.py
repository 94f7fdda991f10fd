"""`launch/k8s_elastic.sh` against a scripted cluster: a fake `kubectl` that stores each Job
spec applied and answers `get pods` and `get nodes` from a scenario, one entry per Job. The
supervisor's decisions are checked: the size and arguments of each Job it applies (from the
real `python -m spmd3d.elastic`), growing back, and where it stops. Training itself under a lost
host is `test_elastic.py`'s (local launcher); no cluster runs here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from test_elastic import DP2_PP2_TP2, DP4_TP2, MODEL

ROOT = Path(__file__).resolve().parent.parent
SUPERVISOR = ROOT / "launch" / "k8s_elastic.sh"

KUBECTL = f"""#!{sys.executable}
import json, sys
from pathlib import Path
here = Path(__file__).parent
cluster = json.loads((here / "cluster.json").read_text())
args = sys.argv[1:]
with open(here / "calls", "a") as calls:
    calls.write(" ".join(args) + "\\n")
if args[0] == "apply":
    cluster["applied"] += 1
    (here / f"job{{cluster['applied']}}.yaml").write_text(sys.stdin.read())
elif args[:2] == ["get", "pods"]:
    print("\\n".join(cluster["jobs"][cluster["applied"] - 1]["pods"]))
elif args[:2] == ["get", "nodes"]:
    for i, (ready, gpus) in enumerate(cluster["jobs"][cluster["applied"] - 1]["nodes"]):
        print(f"node{{i}} {{ready}} {{gpus}} ")
(here / "cluster.json").write_text(json.dumps(cluster))
"""

UP, DOWN = ["True", 2], ["False", 2]


def supervise(tmp_path: Path, jobs: list[dict], layout: list[str], pods: int = 4):
    """Run the supervisor for `pods` pods over the scenario `jobs` -> (exit status, stderr,
    the Job specs it applied)."""
    (tmp_path / "cluster.json").write_text(json.dumps({"applied": 0, "jobs": jobs}))
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(KUBECTL)
    kubectl.chmod(0o755)
    env = {**os.environ, "KUBECTL": str(kubectl), "PYTHON": sys.executable,
           "SPMD3D_GPUS": "2", "SPMD3D_POLL_S": "0", "SPMD3D_PENDING_S": "0"}
    out = subprocess.run(["bash", str(SUPERVISOR), str(pods), *MODEL, *layout,
                          "run.dir=/runs/el"], env=env, capture_output=True, text=True,
                         timeout=300)
    specs = [list(yaml.safe_load_all(p.read_text()))
             for p in sorted(tmp_path.glob("job*.yaml"))]
    return out.returncode, out.stderr, specs


def job_of(spec):
    """(completions, parallelism, JAX_NUM_PROCESSES, retries per index, training args)."""
    job = next(d for d in spec if d["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    return (job["spec"]["completions"], job["spec"]["parallelism"], env["JAX_NUM_PROCESSES"],
            job["spec"]["backoffLimitPerIndex"], container["args"])


def test_a_lost_node_gives_a_smaller_job_with_the_same_batch_and_a_node_back_the_whole_one(
        tmp_path):
    base = [*MODEL, *DP4_TP2, "run.dir=/runs/el"]
    status, err, specs = supervise(tmp_path, [
        {"pods": ["Running "] * 3 + ["Failed 137"], "nodes": [UP] * 3 + [DOWN]},
        {"pods": ["Running "] * 2 + ["Failed 1"], "nodes": [UP] * 4},  # the node is back
        {"pods": ["Succeeded 0"] * 4, "nodes": [UP] * 4},
    ], DP4_TP2)
    assert status == 0, err
    assert [job_of(s) for s in specs] == [
        (4, 4, "4", 0, base),
        (3, 3, "3", 0, base + ["mesh.data=3", "train.microbatches=2"]),
        (4, 4, "4", 0, base + ["mesh.data=4", "train.microbatches=1"]),
    ]
    assert "3 of 4 nodes ready; restart 1" in err and "job spmd3d finished" in err
    # each Job is applied once the one before is gone, pods and all
    calls = [c.split()[:2] for c in (tmp_path / "calls").read_text().splitlines()
             if c.startswith(("apply", "delete"))]
    assert calls == [["delete", "job"], ["apply", "-f"]] * 3
    assert all("--cascade=foreground --wait=true" in c
               for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("delete"))


def test_a_pod_no_node_takes_counts_as_lost(tmp_path):
    status, err, specs = supervise(tmp_path, [
        {"pods": ["Running "] * 3 + ["Pending "], "nodes": [UP] * 3 + [DOWN]},
        {"pods": ["Succeeded 0"] * 3, "nodes": [UP] * 3 + [DOWN]},
    ], DP4_TP2)
    assert status == 0, err
    assert [job_of(s)[:3] for s in specs] == [(4, 4, "4"), (3, 3, "3")]


def test_too_few_nodes_left_stop_with_the_reason(tmp_path):
    # stage 2 x tensor 2 needs two hosts of 2 devices
    status, err, specs = supervise(tmp_path, [
        {"pods": ["Failed 137"] + ["Running "] * 3, "nodes": [UP] + [DOWN] * 3},
    ], DP2_PP2_TP2)
    assert status == 1 and len(specs) == 1
    assert err.strip().splitlines()[-1].startswith("elastic: cannot go on: ")


def test_bad_input_stops_at_once(tmp_path):
    status, err, specs = supervise(tmp_path, [
        {"pods": ["Failed 2"] * 4, "nodes": [UP] * 4},
    ], DP4_TP2)
    assert status == 2 and len(specs) == 1, err
    assert "exited 2 (bad input)" in err


def test_a_pod_count_that_is_not_a_number_is_refused_with_one_line():
    for argv in ([], ["four"], ["0"]):
        out = subprocess.run(["bash", str(SUPERVISOR), *argv], capture_output=True, text=True,
                             env={**os.environ, "KUBECTL": "false"}, timeout=60)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith("usage: launch/k8s_elastic.sh PODS")
