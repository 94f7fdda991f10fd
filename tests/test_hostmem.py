"""The host allocator under XLA:CPU (hostmem): a freed block above glibc's 32 MiB mmap cap is
kept for the next one, once `keep_freed_memory` ran, or `runtime.setup` for CPU devices did;
without it every page of the block is faulted in again (what each step's temporaries cost).
Page faults are counted, not timed: the count does not depend on the machine's load."""

import subprocess
import sys

import pytest

from spmd3d import hostmem

BLOCK = 40 << 20  # one device's temporaries on the benchmark model under FSDP 8 (39 MB)

PROBE = f"""
import ctypes, resource, sys
from spmd3d import hostmem
if sys.argv[1] == "kept":
    assert hostmem.keep_freed_memory()
if sys.argv[1] == "setup":
    import jax
    from spmd3d import config, runtime
    runtime.setup(config.load(None, ["model.num_layers=1", "model.d_model=32",
                                     "model.num_heads=2", "model.num_kv_heads=2",
                                     "model.d_ff=64", "model.vocab_size=256",
                                     "train.seq_len=16", "train.global_batch=2",
                                     "mesh.data=1", "mesh.tensor=1", "mesh.simulated_devices=0",
                                     "run.dir=unused"]), jax.devices()[:1])
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def block():  # what XLA:CPU does with a step's temporaries: malloc, write, free
    p = libc.malloc({BLOCK})
    ctypes.memset(p, 1, {BLOCK})
    libc.free(ctypes.c_void_p(p))
block(); block()  # the first one faults in either way; the second raises glibc's own threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("mode", ["kept", "setup"])
def test_a_freed_block_is_reused_not_faulted_in_again(mode):
    pages = BLOCK // 4096
    assert faults("default") > pages // 2  # glibc's own policy maps and faults it every time
    assert faults(mode) < pages // 20


def test_it_is_set_once():
    assert hostmem.keep_freed_memory() and hostmem.keep_freed_memory()
