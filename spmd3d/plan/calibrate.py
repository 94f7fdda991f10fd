"""`plan --calibrate BENCH.json`: the step-time model's efficiencies from a measured run.

`python -m spmd3d.bench CONFIG --json` on the real hardware records the config it ran, its
devices' peak and its median step time. The planner predicts that same step (`estimate.py`) at
the topology's assumed efficiencies; the measured time less the exposed communication it
predicts is what compute took, so both compute efficiencies (matmuls and attention) are scaled
by one factor that makes the prediction equal the measurement. One run, one factor: the ratio
of matmul to attention efficiency, link efficiency and overlap stay the topology's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .. import config
from ..config import ConfigError


def read_record(path: str) -> dict:
    """The bench record in `path`: a JSON object, or the last line of `bench --json`'s output."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ConfigError("--calibrate", f"cannot read {path!r} ({e.strerror})") from None
    for line in [text, *reversed(text.strip().splitlines())]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            break
    else:
        raise ConfigError("--calibrate", f"{path} holds no JSON object (the record "
                                         "`python -m spmd3d.bench --json` prints last)")
    missing = [k for k in ("cfg", "devices", "peak_tflops", "step_time_median_s") if k not in record]
    if missing:
        raise ConfigError("--calibrate", f"{path} is not a bench record with its config: it "
                                         f"lacks {', '.join(missing)}")
    return record


def calibrate(path: str, topology) -> tuple[object, dict, str]:
    """(the topology with calibrated efficiencies, the calibration's record, a line saying it)."""
    from . import Plan, estimate

    r = read_record(path)
    cfg = config.load(base=r["cfg"])
    # the measured run on its own hardware: its devices' peak, this topology's links
    if "cpu" in str(r.get("device_kind", "")).lower():
        raise ConfigError("--calibrate", f"{path} was measured on CPU devices, which say "
                                         "nothing of a GPU cluster's efficiencies")
    per_device = r["peak_tflops"] / r["devices"]
    measured_on = replace(topology, peak_tflops=tuple(sorted(
        {**dict(topology.peak_tflops), cfg.model.dtype: per_device}.items())))
    plan = Plan.resolve(config.resolve_mesh(cfg, r["devices"]), topology=measured_on)
    t = estimate.step_time(plan)
    compute = r["step_time_median_s"] - t["exposed_comm_s"]
    if compute <= 0:
        raise ConfigError("--calibrate", f"the measured step ({r['step_time_median_s']:.4f} s) is "
                                         f"shorter than its predicted exposed communication "
                                         f"({t['exposed_comm_s']:.4f} s)")
    factor = t["compute_s"] / compute
    matmul = topology.matmul_efficiency * factor
    attention = topology.attention_efficiency * factor
    if max(matmul, attention) > 1:
        raise ConfigError("--calibrate", f"{path} implies {matmul:.0%} of peak in matmuls: its "
                                         f"peak ({r['peak_tflops']:g} TFLOP/s) is not the "
                                         "hardware's")
    calibrated = replace(topology, matmul_efficiency=matmul, attention_efficiency=attention)
    record = {"bench": str(path), "measured_s": r["step_time_median_s"],
              "predicted_s": t["step_s"], "factor": factor, "matmul_efficiency": matmul,
              "attention_efficiency": attention}
    note = (f"calibrated from {path} ({r.get('config', '?')} on {r['devices']} "
            f"{r.get('device_kind', 'devices')}): measured {r['step_time_median_s']:.4f} s a step, "
            f"predicted {t['step_s']:.4f} s; matmul_efficiency {topology.matmul_efficiency:.2f}"
            f" -> {matmul:.3f}, attention_efficiency {topology.attention_efficiency:.2f} -> "
            f"{attention:.3f} (put them in the topology's YAML to keep them)")
    return calibrated, record, note
