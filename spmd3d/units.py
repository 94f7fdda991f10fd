"""Bytes as the reports print them: one module for every command's numbers.

`human` picks the unit (decimal GB for memory, binary GiB for files on disk), `gb` a fixed
number of decimal gigabytes for columns, `gib` the benchmark's binary gigabytes."""

from __future__ import annotations


def human(n: float, binary: bool = False) -> str:
    """`n` bytes in the largest unit it reaches: "12.3 GB" (binary: "11.5 GiB"), "512 B"."""
    base, units = (1024, ("KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("KB", "MB", "GB",
                                                                            "TB"))
    for power in range(len(units), 0, -1):
        if n >= base ** power:
            return f"{n / base ** power:.1f} {units[power - 1]}"
    return f"{n:.0f} B"


def gb(n: float, width: int = 0) -> str:
    """`n` bytes as decimal gigabytes with two places, right-aligned in `width`."""
    return f"{n / 1e9:{width}.2f}"


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"
