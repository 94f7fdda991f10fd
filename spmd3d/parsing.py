"""The two config values with a syntax of their own: XLA flags (`run.xla_flags`, and the
`XLA_FLAGS` environment variable) and data mixtures (`data.mixture`)."""

from __future__ import annotations

import math
import re

from .schema import ConfigError, DataError


_XLA_FLAG = re.compile(r"--([A-Za-z0-9_]+)(=\S*)?")


def parse_xla_flags(text: str, field: str = "run.xla_flags") -> dict[str, str | None]:
    """`--name=value --name ...` -> {name: value, or None for a bare `--name`}; a repeated name
    keeps its last value, as XLA does. Anything else raises ConfigError(field, ...)."""
    flags: dict[str, str | None] = {}
    for token in text.split():
        m = _XLA_FLAG.fullmatch(token)
        if not m:
            raise ConfigError(field, f"{token!r} is not --name=value or --name (XLA flags, "
                                     f"separated by spaces)")
        flags[m.group(1)] = None if m.group(2) is None else m.group(2)[1:]
    return flags


def parse_mixture(spec: str, field: str = "data.mixture") -> list[tuple[str, float]]:
    """`PATH=WEIGHT,PATH=WEIGHT,...` -> [(path, weight)], refused naming the field when a
    weight is not a non-negative number or all are zero."""
    out = []
    for entry in (e.strip() for e in spec.split(",")):
        path, sep, weight = entry.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not sep or not path.strip() or value is None or not math.isfinite(value):
            raise DataError(field, f"{entry!r} is not PATH=WEIGHT (sources are "
                                   "PATH=WEIGHT,PATH=WEIGHT,...)")
        if value < 0:
            raise DataError(field, f"{path.strip()}'s weight {weight} is negative")
        out.append((path.strip(), value))
    if not sum(w for _, w in out) > 0:
        raise DataError(field, "every weight is zero")
    return out
