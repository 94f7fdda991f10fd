"""Multi-host pieces that need no second process: discovery under faked SLURM / Kubernetes /
JAX environments, the shipped launchers (they parse, and set exactly what discovery reads),
the host layout of the mesh, the watchdog's verdicts, and which batch rows a device reads."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmd3d.config import ConfigError, DistConfig
from spmd3d.data import TokenBatches
from spmd3d.dist import (VERDICT_KEY, Cluster, Watchdog, discover, first_host,
                         make_global_batch)
from spmd3d.mesh import AXES, split_over_hosts

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"


# ------------------------------------------------------------------------------- discovery

@pytest.mark.parametrize("nodelist, host", [
    ("node07", "node07"),
    ("node07,node08", "node07"),
    ("node[01-04,07]", "node01"),
    ("node[007,009-012],gpu[1-2]", "node007"),
    ("gpu-a[3-4],gpu-b1", "gpu-a3"),
    ("rack[1-2]-node[05-06]", "rack1-node05"),
    ("10.0.0.[5-8]", "10.0.0.5"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "node[01-04", "node[[1]]", "[]"])
def test_first_host_rejects_garbage(nodelist):
    with pytest.raises(ValueError):
        first_host(nodelist)


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_PROCID": "2", "SLURM_STEP_NODELIST": "gpu[017-019,023]",
         "SLURM_JOB_NODELIST": "gpu[017-019,023]", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("dist, environ, expected", [
    (DistConfig(), {}, Cluster("", 1, 0, "single")),
    (DistConfig(), {"JAX_COORDINATOR_ADDRESS": "h:1"}, Cluster("", 1, 0, "single")),
    (DistConfig("10.1.1.1:999", 3, 2), {}, Cluster("10.1.1.1:999", 3, 2, "config")),
    # the config wins over the environment
    (DistConfig("h0:5", 2, 1), SLURM, Cluster("h0:5", 2, 1, "config")),
    (DistConfig(), {"JAX_COORDINATOR_ADDRESS": "head:1234", "JAX_NUM_PROCESSES": "8",
                    "JAX_PROCESS_ID": "7"}, Cluster("head:1234", 8, 7, "jax")),
    (DistConfig(), {"JAX_COORDINATOR_ADDRESS": "job-0.svc:61440", "JAX_NUM_PROCESSES": "4",
                    "JOB_COMPLETION_INDEX": "3"}, Cluster("job-0.svc:61440", 4, 3, "kubernetes")),
    # 61440 + 4242 % 4096
    (DistConfig(), SLURM, Cluster("gpu017:61586", 4, 2, "slurm")),
    (DistConfig(), {**SLURM, "SPMD3D_COORDINATOR_PORT": "7000"},
     Cluster("gpu017:7000", 4, 2, "slurm")),
    (DistConfig(coordinator="login1:9"), SLURM, Cluster("login1:9", 4, 2, "slurm")),
    (DistConfig(), {**SLURM, "JAX_COORDINATOR_ADDRESS": "x:1"}, Cluster("x:1", 4, 2, "slurm")),
    # the job's nodelist when the step's is missing; SLURM_NTASKS when the step count is
    (DistConfig(), {k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_NODELIST",
                                                                "SLURM_STEP_NUM_TASKS")},
     Cluster("gpu017:61586", 4, 2, "slurm")),
    # one srun task (or an interactive allocation): a single process
    (DistConfig(), {**SLURM, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"},
     Cluster("", 1, 0, "slurm")),
    (DistConfig(), {"JOB_COMPLETION_INDEX": "0"}, Cluster("", 1, 0, "single")),
])
def test_discover(dist, environ, expected):
    assert discover(dist, environ) == expected


@pytest.mark.parametrize("dist, environ, field", [
    (DistConfig(num_processes=2), {}, "dist.coordinator"),
    (DistConfig(), {**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID"),
    (DistConfig(), {**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID"),
    (DistConfig(), {**SLURM, "SLURM_STEP_NUM_TASKS": "0", "SLURM_PROCID": "0"},
     "SLURM_STEP_NUM_TASKS"),
    (DistConfig(), {**SLURM, "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID"),
    (DistConfig(), {**SLURM, "SPMD3D_COORDINATOR_PORT": "http"}, "SPMD3D_COORDINATOR_PORT"),
    (DistConfig(), {**SLURM, "SLURM_STEP_NODELIST": "gpu[01-"}, "SLURM_STEP_NODELIST"),
    (DistConfig(), {k: v for k, v in SLURM.items() if "NODELIST" not in k}, "SLURM_STEP_NODELIST"),
    (DistConfig(), {"JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID"),
    (DistConfig(), {"JAX_PROCESS_ID": "1"}, "JAX_NUM_PROCESSES"),
    (DistConfig(), {"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "1"}, "JAX_NUM_PROCESSES"),
    (DistConfig(), {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "dist.coordinator"),
    (DistConfig(), {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
                    "JAX_COORDINATOR_ADDRESS": "nohost"}, "JAX_COORDINATOR_ADDRESS"),
    (DistConfig(), {"JOB_COMPLETION_INDEX": "3"}, "JAX_NUM_PROCESSES"),
    (DistConfig(), {"JAX_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": "2",
                    "JAX_COORDINATOR_ADDRESS": "h:1"}, "JOB_COMPLETION_INDEX"),
])
def test_discover_names_what_is_wrong(dist, environ, field):
    with pytest.raises(ConfigError) as e:
        discover(dist, environ)
    assert e.value.field == field
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, field", [
    ("dist.coordinator=localhost", "dist.coordinator"),
    ("dist.coordinator=host:99999", "dist.coordinator"),
    ("dist.heartbeat_timeout_s=1", "dist.heartbeat_timeout_s"),
    ("dist.init_timeout_s=0", "dist.init_timeout_s"),
    ("dist.process_id=2", "dist.process_id"),
])
def test_dist_config_validation(override, field):
    from spmd3d import config

    with pytest.raises(ConfigError) as e:
        config.load(None, ["dist.num_processes=2", override])
    assert e.value.field == field


# -------------------------------------------------------------------------------- launchers

@pytest.mark.parametrize("script", ["local.sh", "slurm.sbatch"])
def test_launch_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True, timeout=30)


def _sbatch_options(text: str) -> dict:
    opts = {}
    for m in re.finditer(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", text, re.M):
        opts[m.group(1)] = m.group(2)
    return opts


def test_slurm_script_starts_one_task_per_host_that_discovery_reads(tmp_path):
    """Run the batch script with a stand-in `srun` that records what it was asked to start;
    then feed discovery the environment srun gives each task (SLURM's documented variables
    for --nodes hosts with --ntasks-per-node=1) plus whatever the script exported."""
    text = (LAUNCH / "slurm.sbatch").read_text()
    opts = _sbatch_options(text)
    assert opts["ntasks-per-node"] == "1" and "gpus-per-node" in opts
    nodes = int(opts["nodes"])

    bin_dir = _slurm_stand_ins(tmp_path, [f"h{10 + i}" for i in range(nodes)],
                               'printf "%s\\n" "$@" > "$RECORD.args"\nenv > "$RECORD.env"\n')
    batch_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "srun"),
                 "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "77", "PYTHON": "python3",
                 "SLURM_JOB_NODELIST": f"h[10-{9 + nodes}]", "SLURM_NNODES": str(nodes)}
    subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "configs/demo.yaml", "train.steps=3"],
                   env=batch_env, check=True, timeout=30)

    args = (tmp_path / "srun.args").read_text().split("\n")[:-1]
    assert "--ntasks-per-node=1" in args and "--kill-on-bad-exit=1" in args
    assert f"--nodes={nodes}" in args and "--nodelist=" + ",".join(
        f"h{10 + i}" for i in range(nodes)) in args
    assert args[-5:] == ["python3", "-m", "spmd3d.train", "configs/demo.yaml", "train.steps=3"]
    exported = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines()
                    if "=" in line)
    for rank in range(nodes):
        task_env = {**exported, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(nodes),
                    "SLURM_NTASKS": str(nodes), "SLURM_STEP_NODELIST": f"h[10-{9 + nodes}]",
                    "SLURM_LOCALID": "0"}
        want = Cluster(f"h10:{61440 + 77}", nodes, rank, "slurm")
        assert discover(DistConfig(), task_env) == want


def _slurm_stand_ins(tmp_path, hosts: list[str], srun: str, down: tuple = ()):
    """A bin directory of stand-ins for `srun` (running the bash `srun`), `scontrol show
    hostnames` (printing `hosts`) and `sinfo` (each host alloc, those in `down` down*)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    states = "".join(f"{h} {'down*' if h in down else 'alloc'}\n" for h in hosts)
    for name, body in [("srun", srun), ("scontrol", f"printf '{chr(10).join(hosts)}\\n'\n"),
                       ("sinfo", f"printf '{states.replace(chr(10), chr(92) + 'n')}'\n")]:
        tool = bin_dir / name
        tool.write_text("#!/usr/bin/env bash\n" + body)
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_slurm_elastic_restarts_on_the_nodes_that_respond(tmp_path):
    """`slurm.sbatch --elastic` on 2 nodes of 8 GPUs, data 2 x tensor 8: the first step fails
    and sinfo has h11 down; the script asks `spmd3d.elastic` and starts again on h10 alone,
    with data 1 and twice the microbatches (the global batch kept)."""
    calls = tmp_path / "calls"
    srun = (f'n=$(ls {calls} 2>/dev/null | wc -l); mkdir -p {calls}; '
            f'printf "%s\\n" "$@" > {calls}/$n; ((n == 0)) && exit 1; exit 0\n')
    bin_dir = _slurm_stand_ins(tmp_path, ["h10", "h11"], srun, down=("h11",))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_JOB_ID": "77", "PYTHON": sys.executable, "SLURM_JOB_NODELIST": "h[10-11]",
           "SLURM_GPUS_ON_NODE": "8", "PYTHONPATH": str(REPO)}
    out = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--elastic", "mesh.data=2",
                          "mesh.tensor=8", "train.global_batch=8", "model.num_heads=8",
                          "model.num_kv_heads=8"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, second = ((calls / str(i)).read_text().split("\n")[:-1] for i in (0, 1))
    assert "--nodes=2" in first and "--nodelist=h10,h11" in first
    assert "--nodes=1" in second and "--nodelist=h10" in second
    assert second[-2:] == ["mesh.data=1", "train.microbatches=2"]
    assert "1 of 2 nodes respond; restart 1" in out.stderr


def test_k8s_manifest_sets_what_discovery_reads():
    docs = [d for d in yaml.safe_load_all((LAUNCH / "k8s.yaml").read_text()) if d]
    svc = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    n = spec["completions"]
    assert spec["parallelism"] == n and n > 1
    # the headless Service gives pod <job>-<index> the name <job>-<index>.<service>
    assert svc["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == svc["metadata"]["name"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "spmd3d.train"]
    port = svc["spec"]["ports"][0]["port"]
    assert port in [p["containerPort"] for p in container["ports"]]
    env = {e["name"]: e["value"] for e in container["env"]}
    coordinator = f"{job['metadata']['name']}-0.{svc['metadata']['name']}:{port}"
    for index in range(n):  # Kubernetes sets JOB_COMPLETION_INDEX in each pod
        got = discover(DistConfig(), {**env, "JOB_COMPLETION_INDEX": str(index)})
        assert got == Cluster(coordinator, n, index, "kubernetes")


# -------------------------------------------------------------------------- hosts and mesh

def _sizes(data, stage, tensor, seq):
    return dict(zip(AXES, (data, stage, tensor, seq)))


@pytest.mark.parametrize("sizes, per_host, hosts, inner, outer", [
    # 2 hosts x 4: tensor and stage inside, data across
    (_sizes(2, 2, 2, 1), 4, 2, [1, 2, 2, 1], [2, 1, 1, 1]),
    # 8 hosts x 8 GPUs: TP 8 inside, PP 2 x DP 4 across
    (_sizes(4, 2, 8, 1), 8, 8, [1, 1, 8, 1], [4, 2, 1, 1]),
    (_sizes(8, 1, 2, 1), 8, 2, [4, 1, 2, 1], [2, 1, 1, 1]),
    (_sizes(1, 4, 2, 2), 4, 4, [1, 1, 2, 2], [1, 4, 1, 1]),
])
def test_split_over_hosts_keeps_tensor_and_seq_inside(sizes, per_host, hosts, inner, outer):
    assert split_over_hosts(sizes, per_host, hosts) == (inner, outer)


@pytest.mark.parametrize("sizes, per_host, hosts, field", [
    (_sizes(1, 1, 8, 1), 4, 2, "mesh.tensor"),        # TP 8 on 4-device hosts
    (_sizes(2, 1, 2, 2), 2, 4, "mesh.tensor"),        # seq fills the host, tensor spills over
    (_sizes(1, 1, 1, 8), 4, 2, "mesh.seq"),
    (_sizes(4, 1, 3, 1), 4, 3, "mesh.tensor"),        # 3 does not divide a 4-device host
    (_sizes(2, 2, 2, 1), 4, 3, "mesh"),               # 8 devices are not 3 hosts of 4
])
def test_tensor_or_seq_across_hosts_is_an_error(sizes, per_host, hosts, field):
    with pytest.raises(ConfigError) as e:
        split_over_hosts(sizes, per_host, hosts)
    assert e.value.field == field
    if field != "mesh":
        assert "mesh.allow_cross_host=true" in str(e.value)


def test_tensor_inside_lets_seq_span_hosts():
    """mesh.inside=tensor: tensor 8 x seq 8 on hosts of 8 keeps tensor inside each host and
    runs the ring across them; by default (seq first) tensor would span hosts, and the error
    names the field that fixes it."""
    sizes = _sizes(1, 1, 8, 8)
    assert split_over_hosts(sizes, 8, 8, inside="tensor") == ([1, 1, 8, 1], [1, 1, 1, 8])
    with pytest.raises(ConfigError, match="mesh.inside=tensor") as e:
        split_over_hosts(sizes, 8, 8)
    assert e.value.field == "mesh.tensor"
    with pytest.raises(ConfigError) as e:  # tensor itself larger than a host: still refused
        split_over_hosts(_sizes(1, 1, 16, 4), 8, 8, inside="tensor")
    assert e.value.field == "mesh.tensor"


def test_hsdp_keeps_a_zero_group_inside_a_host():
    """mesh.replicate: a ZeRO group (the `data` axis) fills a host after tensor and seq, and
    the copies (`replicate`, outermost) go across hosts: data 16 as 4 copies of 4 on hosts of
    8 with tensor 2."""
    from spmd3d import config
    cfg = config.load(None, ["mesh.data=16", "mesh.replicate=4", "mesh.tensor=2",
                             "mesh.simulated_devices=0", "train.global_batch=16"])
    sizes = cfg.mesh.sizes()
    assert sizes == {"data": 4, "stage": 1, "tensor": 2, "seq": 1, "replicate": 4}
    assert split_over_hosts(sizes, 8, 4) == ([1, 4, 1, 2, 1], [4, 1, 1, 1, 1])


def test_allow_cross_host_forces_the_layout():
    inner, outer = split_over_hosts(_sizes(2, 1, 2, 2), 2, 4, allow_cross_host=True)
    assert (inner, outer) == ([1, 1, 1, 2], [2, 1, 2, 1])


def test_allow_cross_host_is_a_mesh_field_off_by_default():
    from spmd3d import config

    assert config.load().mesh.allow_cross_host is False
    assert config.load(None, ["mesh.allow_cross_host=true"]).mesh.allow_cross_host is True


# ------------------------------------------------------------------------------- watchdog

class FakeKV:
    """The slice of jax's coordination-service client the watchdog uses."""

    def __init__(self):
        self.store, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        if key in self.store and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.store[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


def _watchdogs(n, timeout=10.0):
    kv, now = FakeKV(), [0.0]
    dogs = [Watchdog(kv, Cluster("h:1", n, i, "config"), timeout, clock=lambda: now[0])
            for i in range(n)]
    return kv, now, dogs


def test_watchdog_names_the_silent_process_after_the_timeout():
    kv, now, dogs = _watchdogs(3)
    for t in range(0, 10):  # everyone beats for 10 s
        now[0] = float(t)
        assert all(d.poll() is None for d in dogs)
    for t in range(10, 19):  # process 1 is gone: not yet 10 s of silence
        now[0] = float(t)
        assert dogs[0].poll() is None and dogs[2].poll() is None
    now[0] = 20.0
    for d in (dogs[0], dogs[2]):
        msg = d.poll()
        assert msg.startswith("lost process 1 (") and " of 3: no heartbeat for 10 s" in msg, msg


def test_watchdog_verdict_reaches_every_process_and_process_0_leaves_last():
    """The first verdict is posted for all; process 0, whose exit takes the coordination
    service down, waits a few beats so the others can read it."""
    kv, now, dogs = _watchdogs(3, timeout=2.0)
    exits, lines = [], []

    class Out:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    for d in dogs:
        d.exit_fn = lambda code, d=d: exits.append((d.cluster.process_id, code, time.monotonic()))
        d.out = Out()
    assert all(d.poll() is None for d in dogs)
    kv.store[VERDICT_KEY] = "lost process 7 (x 1) of 3: test"
    started = time.monotonic()
    for d in dogs:
        d._run()  # returns after the verdict is printed and exit_fn called
    assert [(i, code) for i, code, _ in exits] == [(0, 1), (1, 1), (2, 1)]
    assert exits[0][2] - started >= 3 * dogs[0].interval  # one beat, then it lingered
    printed = "".join(lines).splitlines()
    assert printed == [f"error: lost process 7 (x 1) of 3: test; process {i} stops"
                       for i in range(3)]


def test_watchdog_pause_of_its_own_process_is_no_false_alarm():
    kv, now, dogs = _watchdogs(2)
    assert dogs[0].poll() is None and dogs[1].poll() is None
    now[0] = 60.0  # process 0 was frozen for a minute while process 1 kept beating
    dogs[1].poll()
    assert dogs[0].poll() is None


def test_watchdog_reports_a_lost_coordinator_but_not_at_the_normal_end():
    kv, now, dogs = _watchdogs(2)
    assert dogs[1].poll() is None
    kv.down = True
    assert dogs[1].poll() is None  # one failed RPC may be transient
    now[0] = 6.0
    assert "lost the coordinator (process 0 at h:1)" in dogs[1].poll()
    dogs[1].exiting.set()  # at exit jax closes the service: that is no loss
    assert dogs[1].poll() is None


def test_watchdog_thread_ends_at_exit_before_the_interpreter_finalizes(monkeypatch):
    """At exit jax's shutdown runs while the thread still watches (a peer lost at the end is
    named), then the thread stops and is joined, so it is never inside a client call when
    the interpreter finalizes (a daemon thread there is ended by a forced unwind through the
    client's C++ code: a finished run aborted)."""
    import atexit

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    calls = []

    class SlowKV(FakeKV):  # a call in flight when the exit comes
        def key_value_dir_get(self, prefix):
            calls.append(time.monotonic())
            time.sleep(0.3)
            return super().key_value_dir_get(prefix)

    dog = Watchdog(SlowKV(), Cluster("h:1", 2, 0, "config"), timeout=1.0)
    dog.start()
    assert registered == [dog.at_exit] and dog.thread.is_alive()
    while not calls:
        time.sleep(0.01)
    shutdowns = []
    dog.at_exit(shutdown=lambda: shutdowns.append(dog.thread.is_alive()))
    assert shutdowns == [True]  # jax's shutdown ran while the thread still watched
    assert not dog.thread.is_alive() and dog.exiting.is_set()  # then it was stopped, joined
    n = len(calls)
    time.sleep(3 * dog.interval)
    assert len(calls) == n  # no beat after the exit


# -------------------------------------------------------------------- per-process batch rows

def test_each_device_reads_its_own_rows_when_a_hosts_rows_are_not_contiguous():
    """Devices 0-3 (think: host 0) hold row blocks 0, 2, 4, 6 of the batch: each device must
    get exactly those rows of the global batch, which `make_global_batch` reads per block."""
    devices = jax.devices()
    order = [devices[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    mesh = Mesh(np.array(order), ("data",))
    sharding = NamedSharding(mesh, P("data", None))
    batches = TokenBatches(np.arange(5000, dtype=np.uint16) % 251, seq_len=16, seed=3,
                           vocab_size=256)
    want = batches.batch(5, 16)  # the whole global batch, as one process reads it
    got = make_global_batch(batches, 5, sharding, 16)
    assert got.shape == (16, 17)
    np.testing.assert_array_equal(np.asarray(got), want)
    host0 = {d: i for i, d in enumerate(order)}
    for shard in got.addressable_shards:
        block = host0[shard.device]
        np.testing.assert_array_equal(np.asarray(shard.data), want[2 * block: 2 * block + 2])
    rows_of_host0 = sorted(shard.index[0].start for shard in got.addressable_shards
                           if shard.device.id < 4)
    assert rows_of_host0 == [0, 4, 8, 12]  # blocks 0, 2, 4, 6: not contiguous


def test_replicated_rows_are_the_whole_batch_on_every_device():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("stage", "tensor"))
    batches = TokenBatches(np.arange(3000, dtype=np.uint16) % 200, seq_len=8, seed=0,
                           vocab_size=256)
    got = make_global_batch(batches, 2, NamedSharding(mesh, P()), 8)
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), batches.batch(2, 8))
