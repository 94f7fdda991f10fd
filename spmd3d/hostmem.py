"""The host allocator under XLA:CPU: keep a step's freed temporaries for the next step.

XLA:CPU takes a step's temporaries from malloc as one block per device (the compiled step's
`temp_size_in_bytes`) and frees it when the step ends. glibc serves a block above its mmap
threshold with a fresh mapping and unmaps it on free; the threshold adapts to the blocks freed,
but never above 32 MiB. So once a device's temporaries pass 32 MiB, every step maps them anew
and the kernel faults in and zeroes every page, on every simulated device. On the benchmark
model under FSDP over 8 devices (39 MB of temporaries a device) that was 77,000 page faults a
step, about 9 % of the step's CPU time in the kernel, 7 % of its tokens/s.

`keep_freed_memory` sets the two thresholds once: blocks up to 1 GiB come from the heap, and
freed memory stays there for the next step's block instead of going back to the system. The
resident size then stays at its peak between steps (the peak itself does not change). It is
glibc's `mallopt`; on another C library (macOS, musl) it returns False. `runtime.setup`
calls it for CPU devices: on a GPU the temporaries live in the device's own allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 1 << 30  # larger blocks are still mapped (and returned) one by one
TRIM_THRESHOLD = 2 ** 31 - 1  # mallopt takes an int: in effect, never trim

_kept = False


def keep_freed_memory() -> bool:
    """Serve blocks up to `MMAP_THRESHOLD` from the heap and keep freed memory there (glibc's
    mallopt, process-wide, once). -> whether the allocator took the settings."""
    global _kept
    if not _kept:
        try:
            mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
        except (OSError, AttributeError):  # not glibc: nothing to set
            return False
        _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                     and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept
