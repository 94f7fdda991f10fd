"""One training job over many processes (hosts): who is who, start-up, and losing a process.

* `discover(cfg.dist, environ)` is a pure function: the job's shape comes from the config
  (`dist.*`), else from what the launcher put in the environment (the standard JAX variables,
  a Kubernetes indexed Job, or SLURM's `srun`), else it is one process.
* `initialize(cfg)` joins the job with `jax.distributed` (gloo collectives on CPU, so local
  processes are a real multi-host job) and starts a `Watchdog`.
* `Watchdog`: when a process dies, a collective on the others fails naming a socket (gloo) or
  hangs (NCCL), and jax aborts them only after its heartbeat timeout, in a stack trace. The
  watchdog beats through the coordination service's key-value store and, when a peer falls
  silent for `dist.heartbeat_timeout_s`, every other process prints one line naming it and
  exits 1.
* `make_global_batch`: each process reads only the rows of the batch its devices hold.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping

from .config import Config, ConfigError, DistConfig

PORT_BASE = 61440  # SLURM default port: PORT_BASE + job id % 4096, above Linux's ephemeral range
PREFIX = "spmd3d/"
BEAT_KEY, VERDICT_KEY = PREFIX + "beat/", PREFIX + "verdict"


@dataclass(frozen=True)
class Cluster:
    """Where this process stands in the job; `source` says where the values came from."""

    coordinator: str  # HOST:PORT of process 0's coordination service ('' for one process)
    num_processes: int
    process_id: int
    source: str  # config | jax | kubernetes | slurm | single

    def describe(self) -> str:
        return (f"process {self.process_id} of {self.num_processes} ({self.source}), "
                f"coordinator {self.coordinator}")


# ---------------------------------------------------------------------------------- discovery

def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'node[01-04,07],gpu3' -> 'node01',
    'rack[1-2]-n[5-6]' -> 'rack1-n5'. The zero padding of a range is kept."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            break
        if ch == "," and depth == 0:
            end = i
            break
    token = nodelist[:end].strip()
    host = re.sub(r"\[([^\[\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0].strip(), token)
    if not host or re.search(r"[\[\],\s]", host):
        raise ValueError(f"cannot read a host from nodelist {nodelist!r}")
    return host


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(name, f"{environ[name]!r} is not an integer") from None


def _slurm_coordinator(environ: Mapping[str, str]) -> str:
    """First host of the step's (else the job's) nodelist : SPMD3D_COORDINATOR_PORT, else
    PORT_BASE + SLURM_JOB_ID % 4096, so that jobs sharing a node get different ports."""
    lists = [n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if environ.get(n)]
    if not lists:
        raise ConfigError("SLURM_STEP_NODELIST", "SLURM gives the process count but no nodelist "
                          "to find process 0 on; set dist.coordinator=HOST:PORT")
    try:
        host = first_host(environ[lists[0]])
    except ValueError as e:
        raise ConfigError(lists[0], str(e)) from None
    if "SPMD3D_COORDINATOR_PORT" in environ:
        return f"{host}:{_int(environ, 'SPMD3D_COORDINATOR_PORT')}"
    job = _int(environ, "SLURM_JOB_ID") if "SLURM_JOB_ID" in environ else 0
    return f"{host}:{PORT_BASE + job % 4096}"


def _count_and_id(dist: DistConfig, environ: Mapping[str, str]):
    """(count, id, source, count's field, id's field): the first source that has them."""
    if dist.num_processes != 1 or dist.process_id != 0:
        return (dist.num_processes, dist.process_id, "config", "dist.num_processes",
                "dist.process_id")
    if "JAX_NUM_PROCESSES" in environ or "JAX_PROCESS_ID" in environ:
        if "JAX_NUM_PROCESSES" not in environ:
            raise ConfigError("JAX_NUM_PROCESSES", "JAX_PROCESS_ID is set but not the count")
        ids = [f for f in ("JAX_PROCESS_ID", "JOB_COMPLETION_INDEX") if f in environ]
        if not ids:
            raise ConfigError("JAX_PROCESS_ID", "JAX_NUM_PROCESSES is set but neither "
                              "JAX_PROCESS_ID nor JOB_COMPLETION_INDEX (Kubernetes indexed Job) "
                              "says which process this is")
        source = "jax" if ids[0] == "JAX_PROCESS_ID" else "kubernetes"
        return (_int(environ, "JAX_NUM_PROCESSES"), _int(environ, ids[0]), source,
                "JAX_NUM_PROCESSES", ids[0])
    if environ.get("JOB_COMPLETION_INDEX", "0") != "0":
        raise ConfigError("JAX_NUM_PROCESSES", f"this is pod {environ['JOB_COMPLETION_INDEX']} "
                          "of a Kubernetes indexed Job, but JAX_NUM_PROCESSES (the Job's "
                          "completions) is not set")
    counts = [f for f in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if f in environ]
    if "SLURM_PROCID" in environ and counts:
        return (_int(environ, counts[0]), _int(environ, "SLURM_PROCID"), "slurm", counts[0],
                "SLURM_PROCID")
    return 1, 0, "single", "", ""


def discover(dist: DistConfig, environ: Mapping[str, str]) -> Cluster:
    """The job's shape from `dist` (any non-default value), else from the environment:

    - jax:        JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_COORDINATOR_ADDRESS;
    - kubernetes: JAX_NUM_PROCESSES, JOB_COMPLETION_INDEX (an indexed Job's pod index),
                  JAX_COORDINATOR_ADDRESS;
    - slurm:      SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_PROCID, and the coordinator
                  from the nodelist (`_slurm_coordinator`) unless JAX_COORDINATOR_ADDRESS;
    - else one process.

    `dist.coordinator`, when set, wins over any source. Raises ConfigError naming the config
    field or environment variable that is missing or wrong."""
    n, pid, source, count_field, id_field = _count_and_id(dist, environ)
    if n < 1:
        raise ConfigError(count_field, f"{n} processes: must be positive")
    if not 0 <= pid < n:
        raise ConfigError(id_field, f"process id {pid} is not in [0, {n}) ({count_field} = {n})")
    if n == 1:
        return Cluster("", 1, 0, source)
    coordinator, field = dist.coordinator, "dist.coordinator"
    if not coordinator and environ.get("JAX_COORDINATOR_ADDRESS"):
        coordinator, field = environ["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS"
    if not coordinator and source == "slurm":
        coordinator = _slurm_coordinator(environ)
    if not coordinator:
        raise ConfigError("dist.coordinator", f"{n} processes ({source}) but no coordinator: "
                          "set dist.coordinator=HOST:PORT (process 0's host) or "
                          "JAX_COORDINATOR_ADDRESS")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(field, f"{coordinator!r} is not HOST:PORT")
    return Cluster(coordinator, n, pid, source)


# --------------------------------------------------------------------------------- start-up

def initialize(cfg: Config, environ: Mapping[str, str] | None = None) -> Cluster:
    """Join the job `discover` finds (nothing to do for one process).

    Must run after `mesh.simulate_devices` and before jax's backends start. jax's own
    heartbeat timeout is three times ours (it beats every half timeout, so it may notice a
    loss after only half of it) and its shutdown timeout twice, so the watchdog speaks first;
    they remain the backstop for a process whose Python threads cannot run."""
    cluster = discover(cfg.dist, os.environ if environ is None else environ)
    if cluster.num_processes == 1:
        return cluster
    import jax

    timeout = cfg.dist.heartbeat_timeout_s
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # said before joining: a job that never forms fails in jax's words after init_timeout_s
    print(f"{cluster.describe()}: joining (waiting up to dist.init_timeout_s = "
          f"{cfg.dist.init_timeout_s} s for all processes)", flush=True)
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            cluster_detection_method="deactivate",  # one process per host, all its devices
            initialization_timeout=cfg.dist.init_timeout_s,
            heartbeat_timeout_seconds=3 * timeout, shutdown_timeout_seconds=2 * timeout)
    except Exception as e:  # noqa: BLE001 -- say which job could not be joined
        raise RuntimeError(f"{cluster.describe()}: could not join the job: {e}") from e
    from jax._src import distributed  # the client: jax has no public handle on it (orbax
    # reaches it the same way)

    Watchdog(distributed.global_state.client, cluster, timeout).start()
    print(f"{cluster.describe()}: joined with {jax.local_device_count()} local devices on "
          f"{socket.gethostname()}", flush=True)
    return cluster


# --------------------------------------------------------------------------------- watchdog

class Watchdog:
    """Heartbeats through the coordination service's key-value store, in a daemon thread.

    Every `timeout / 10` s this process writes `spmd3d/beat/<id>` = "<count> <host> <pid>" and
    reads every peer's. A peer whose value has not changed for `timeout` s by this process's
    own clock is lost (so a pause of this process itself is no false alarm: it sees fresh
    values when it wakes). The first process to see a loss posts its verdict under
    `spmd3d/verdict`, and every process prints it in one line on stderr and exits 1 with
    `os._exit`: the main thread may be inside a collective that can never finish, and exit
    handlers would wait on it. Process 0 leaves last, as the coordination service dies with
    it (and jax then aborts the others with a message that names no one).
    """

    def __init__(self, client, cluster: Cluster, timeout: float, clock=time.monotonic,
                 exit_fn=os._exit, out=None):
        self.client, self.cluster, self.timeout = client, cluster, float(timeout)
        self.clock, self.exit_fn, self.out = clock, exit_fn, out
        self.interval = min(max(self.timeout / 10, 0.1), 2.0)
        self.me = f"{socket.gethostname()} {os.getpid()}"  # beat value: "<count> <host> <pid>"
        self.count = 0
        self.seen: dict[int, tuple[str, float]] = {}  # peer -> (last value, when it changed)
        self.errors_since: float | None = None
        self.exiting = threading.Event()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        import atexit

        atexit.register(self.at_exit)  # runs before jax's shutdown (registered at its import)
        self.thread = threading.Thread(target=self._run, name="spmd3d-watchdog", daemon=True)
        self.thread.start()

    def at_exit(self, shutdown=None) -> None:
        """jax's shutdown waits for every process and then closes the coordination service:
        run it here (jax's own exit hook then finds it done), still watching peers through
        that wait, so a peer lost at the end is named (a service that goes away is then the
        normal end, not a lost coordinator). Then stop the thread and wait for it: a daemon
        thread still inside the client's C++ call when the interpreter finalizes is ended
        there by a forced unwind, which aborted a finished run ('FATAL: exception not
        rethrown')."""
        self.exiting.set()
        try:
            if shutdown is None:
                import jax

                shutdown = jax.distributed.shutdown
            shutdown()
        finally:
            self.stopped.set()
            if self.thread is not None:
                self.thread.join(timeout=max(10.0, 4 * self.interval))

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            verdict = self.poll()
            if verdict:
                c = self.cluster
                print(f"error: {verdict}; process {c.process_id} stops", flush=True,
                      file=self.out or sys.stderr)
                try:
                    self.client.key_value_set(VERDICT_KEY, verdict)  # first one stays
                except Exception:  # noqa: BLE001 -- posted already, or the service is gone
                    pass
                if c.process_id == 0:  # keep the service up while the others read the verdict
                    time.sleep(2 * self.interval)
                self.exit_fn(1)
                return

    def poll(self) -> str | None:
        """One beat: write ours, read theirs; what is wrong, in words, or None."""
        now, c = self.clock(), self.cluster
        try:
            self.count += 1
            self.client.key_value_set(f"{BEAT_KEY}{c.process_id}", f"{self.count} {self.me}",
                                      allow_overwrite=True)
            keys = dict(self.client.key_value_dir_get(PREFIX))
            self.errors_since = None
        except Exception as e:  # noqa: BLE001 -- any failure to reach the service counts
            self.errors_since = self.errors_since if self.errors_since is not None else now
            if self.exiting.is_set() or now - self.errors_since < min(self.timeout, 5.0):
                return None  # the service closing at the end, or a transient RPC failure
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            return f"lost the coordinator (process 0 at {c.coordinator}): {first}"
        if VERDICT_KEY in keys:
            return keys[VERDICT_KEY]
        lost = []
        for peer in range(c.num_processes):
            if peer == c.process_id:
                continue
            value = keys.get(f"{BEAT_KEY}{peer}", "")
            last = self.seen.get(peer)
            if last is None or last[0] != value:
                self.seen[peer] = (value, now)
            elif now - last[1] >= self.timeout:
                _, host, pid = (value.split() + ["", "", ""])[:3]
                lost.append(f"{peer} (pid {pid} on {host})" if host else f"{peer} (never beat)")
        if not lost:
            return None
        return (f"lost process {', '.join(lost)} of {c.num_processes}: no heartbeat for "
                f"{self.timeout:g} s (dist.heartbeat_timeout_s); it died, was killed or hangs")


# ------------------------------------------------------------------------- per-process data

def host_names() -> list[str]:
    """Each process's host, in process order: `$SPMD3D_HOST` (the local launcher names its
    slots so) or the machine's name. A collective: every process calls it."""
    import jax
    import numpy as np

    me = (os.environ.get("SPMD3D_HOST") or socket.gethostname()).encode()[:64]
    if jax.process_count() == 1:
        return [me.decode()]
    from jax.experimental import multihost_utils

    row = np.zeros(64, np.uint8)
    row[:len(me)] = np.frombuffer(me, np.uint8)
    rows = multihost_utils.process_allgather(row)
    return [bytes(r).rstrip(b"\0").decode() for r in np.asarray(rows).reshape(-1, 64)]


def make_global_batch(batches, step: int, sharding, global_batch: int):
    """Step `step`'s [global_batch, T+1] token array, each process reading only the rows its
    own devices hold.

    The rows a process holds follow from the sharding, not from its process id: with `stage`
    or `tensor` across hosts two processes hold the same rows (and must read the same data),
    and a hybrid mesh need not give process p the p-th block. Each device's rows are an
    aligned block of the batch, read with `batches.batch` as block `start // size`."""
    import jax

    blocks: dict[tuple[int, int], object] = {}  # devices holding the same rows read them once

    def rows(index):
        start, stop, _ = index[0].indices(global_batch)
        if (start, stop) not in blocks:
            size = stop - start
            if start % size or global_batch % size:
                raise ValueError(f"batch rows {start}:{stop} are not an aligned block")
            blocks[start, stop] = batches.batch(step, global_batch, start // size,
                                                global_batch // size)
        return blocks[start, stop][(slice(None),) + tuple(index[1:])]

    shape = (global_batch, batches.seq_len + 1)
    return jax.make_array_from_callback(shape, sharding, rows)


class Preemption:
    """SIGTERM (what SLURM and Kubernetes send before a kill) asks the loop to stop after the
    step in flight, save it and exit 0.

    One process: a signal handler sets a flag. Several: jax's preemption service (started by
    `jax.distributed`) catches the signal on any process and agrees on one step at which all
    of them stop, so every process saves the same step."""

    def __init__(self):
        import signal

        import jax

        self.requested = False
        self._multi = jax.process_count() > 1
        self._previous = None
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.requested = True

    def stop_at(self, step: int) -> bool:
        """Whether to stop once `step` is done (call on every process at every step)."""
        if self._multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self):
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
