"""`python -m spmd3d.plot RUN_DIR [RUN_DIR ...] [--out=FILE]`: the loss curves of one or
several runs as a PNG (`plot_runs`). Exit status 0 done, 2 bad input (a directory without
metrics: one line)."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import cli
from ..schema import DataError
from . import plot_runs

COMMAND = cli.Command(
    prog="python -m spmd3d.plot",
    usage="RUN_DIR [RUN_DIR ...] [--out=FILE]",
    description=("Plot loss and eval loss against steps and tokens for one or several runs "
                 "(overlaid). Writes RUN_DIR/curves.png for one run, ./curves.png for several, "
                 "or --out. Exit status 0 done, 2 bad input (one line)."),
    flags=(cli.Flag("--out", kind="str", help="the PNG to write"),),
    takes_config=False,
)


def _run(args: cli.Args) -> int:
    if not args.positional:
        raise DataError("RUN_DIR", "name at least one run directory")
    default = Path(args.positional[0]) / "curves.png" if len(args.positional) == 1 else "curves.png"
    out = plot_runs(args.positional, args.flags.get("--out") or default)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
