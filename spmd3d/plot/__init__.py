"""The training loss and the held-out loss of one or several runs (overlaid: two meshes, two
learning rates) as a PNG, against optimizer steps and against tokens seen, read from each run's
`metrics.jsonl`. A run writes its own `curves.png` this way when it ends; `python -m
spmd3d.plot` is the command (`__main__.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..schema import DataError


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of `RUN_DIR/metrics.jsonl` by step, the last of each step (a resumed run
    logs some steps again); raises DataError when there are none."""
    path = Path(run_dir) / "metrics.jsonl"
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:  # a line a running process is still writing
                continue
            records.setdefault(r["step"], {}).update(r)
    if not records:
        raise DataError("RUN_DIR", f"{run_dir} has no metrics (no records in {path})")
    return [records[s] for s in sorted(records)]


def plot_runs(run_dirs: list, out: str | Path) -> Path:
    """Write the PNG of `run_dirs`' curves to `out`; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    unique = len({d.name for d, _ in runs}) == len(runs)  # else the paths tell them apart
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (d, records), color in zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 9):
        label = d.name if unique else str(d)
        for ax, x in zip(axes, ("step", "tokens")):
            train = [(r[x], r["loss"]) for r in records if "loss" in r and x in r]
            held = [(r[x], r["eval_loss"]) for r in records if "eval_loss" in r and x in r]
            if train:
                ax.plot(*zip(*train), color=color, lw=1.2, label=f"{label}: loss")
            if held:
                ax.plot(*zip(*held), "o--", color=color, ms=4, label=f"{label}: eval loss")
    for ax, x in zip(axes, ("optimizer step", "tokens seen")):
        ax.set_xlabel(x)
        ax.set_ylabel("loss (nats per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(", ".join(d.name for d, _ in runs))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
