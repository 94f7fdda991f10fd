"""Bytes and tables as the reports print them: one module for every command's numbers.

`human` picks the unit (decimal GB for memory, binary GiB for files on disk), `gb` a fixed
number of decimal gigabytes for columns, `gib` the benchmark's binary gigabytes; `columns` lays
out every table the commands and the notebook print."""

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


def cell(x) -> str:
    """One table cell: a float to three places, anything else as str."""
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def columns(rows, header=None, indent: str = "") -> list[str]:
    """Rows of cells as text lines in aligned columns two spaces apart (under `header` and a
    rule of dashes when one is given): every command's and notebook's tables."""
    cells = [[cell(x) for x in r] for r in rows]
    if header is not None:
        cells.insert(0, [str(h) for h in header])
    if not cells:
        return []
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(map(len, cells)))]
    if header is not None:
        cells.insert(1, ["-" * w for w in widths[:len(header)]])
    return [(indent + "  ".join(x.ljust(w) for x, w in zip(r, widths))).rstrip() for r in cells]
