"""Every test runs on 8 simulated CPU devices: the flag must be set before jax is imported.

XLA:CPU's LLVM backend runs at optimisation level 0: the suite is compile-bound (small
programs, few steps) and LLVM's optimisation is a large part of each compile (a quarter of the
suite's time). What the tests assert is decided before it -- the HLO passes, buffer assignment,
the collectives -- and every comparison is between programs compiled alike.

One persistent compilation cache serves the whole session, its xdist workers and the processes
tests start (a run resumed in a fresh process, the processes of a multi-host job, a notebook's
kernel): a program compiled twice is compiled once. It is fresh each session and removed at its
end, so nothing carries over from one run of the suite to the next; so is the directory where
the workers share the one-device references every layout is compared with."""

import atexit
import os
import shutil
import tempfile

for _FLAG in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the session's first process: the workers
    # and every subprocess inherit it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd3d-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
if "SPMD3D_TEST_SHARED" not in os.environ:  # what the workers share (`helpers.reference_run`)
    os.environ["SPMD3D_TEST_SHARED"] = tempfile.mkdtemp(prefix="spmd3d-tests-")
    atexit.register(shutil.rmtree, os.environ["SPMD3D_TEST_SHARED"], True)
