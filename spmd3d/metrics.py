"""Model FLOPs, MFU, and where a run's records go: the terminal line, `metrics.jsonl` and
TensorBoard events (`Sinks`)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from .config import ModelConfig

LOG = logging.getLogger("spmd3d.metrics")


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters a token's matmuls use: every block weight (of an MoE layer, the router, the
    shared experts and the top-k it is sent to: FLOPs by active parameters, as Megatron and
    MaxText count MoE) and the output head."""
    return (cfg.stacked_layers * cfg.active_layer_params + cfg.dense_layers * cfg.dense_layer_params
            + cfg.d_model * cfg.vocab_size)


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: float = 0.5) -> float:
    """Training FLOPs per token (forward + backward, no recompute): 6 N for the matmul
    parameters N (the head included, the embedding lookup not), plus the attention scores and
    their use, 12 L H Q T in PaLM's count for a full T x T score matrix (6 L H (Q + V) T where
    the value head V is narrower than the query's Q: MLA). A causal model needs
    only the half below the diagonal, so MFU counts `causal` = 0.5 of it (as MaxText and
    Megatron do); `causal=1` gives PaLM's figure."""
    attention = 6 * cfg.num_layers * cfg.num_heads * (cfg.dim_per_head + cfg.value_dim) * seq_len
    return 6 * matmul_params(cfg) + causal * attention


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilization against the peak of all the devices used (`flops_per_token`:
    causal attention counted half). Above 1 means the peak is wrong for the device: logged."""
    value = tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops
    if value > 1:
        LOG.warning(f"MFU {100 * value:.0f}% is above 100%: the peak FLOP/s "
                    f"({peak_flops / 1e12:.1f} T) is too low for these devices; set the "
                    "topology's peak_tflops (mesh.topology)")
    return value


class MetricsLog:
    """Appends one JSON object per logged step to `metrics.jsonl` (a resumed run appends)."""

    def __init__(self, path: str | Path | None):
        self.file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    event = write  # a record that is not a step's (a resize): this file only

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class Terminal:
    """The terminal line of each record, through the `spmd3d.metrics` logger (a notebook or
    another program can silence or redirect it), with the time left at the current pace."""

    def __init__(self, total_steps: int):
        self.total = total_steps

    def write(self, record: dict) -> None:
        LOG.info(format_line(record, self.total))

    def close(self) -> None:
        pass


class TensorBoard:
    """Every numeric field of each record as a scalar (tensorboardX: a light writer, no
    TensorFlow), plus the compiled step's per-device memory."""

    def __init__(self, logdir: Path, memory_bytes: int | None = None):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(logdir))
        self.memory = memory_bytes

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        if self.memory:
            self.writer.add_scalar("memory_per_device_gb", self.memory / 1e9, step)

    def close(self) -> None:
        self.writer.close()


class Sinks(list):
    """Where each record of a run goes: a list of sinks, each with `write` and `close`."""

    def write(self, record: dict) -> None:
        for sink in self:
            sink.write(record)

    def event(self, record: dict) -> None:
        """A record that is not a step's metrics: to the sinks that keep such (metrics.jsonl)."""
        for sink in self:
            if hasattr(sink, "event"):
                sink.event(record)

    def close(self) -> None:
        for sink in self:
            sink.close()


def duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_line(r: dict, total_steps: int) -> str:
    parts = [f"step {r['step']:>{len(str(total_steps))}}/{total_steps}"]
    if "loss" in r:
        parts += [f"loss {r['loss']:.4f}", f"grad_norm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}",
                  f"{r['tokens_per_s']:,.0f} tok/s", f"{r['step_time_s']:.3f} s/step"]
        if not math.isnan(r.get("mfu", math.nan)):
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if "moe_imbalance" in r:
            parts.append(f"experts: aux {r['moe_aux_loss']:.3f} imbalance "
                         f"{r['moe_imbalance']:.2f}")
    if "eval_loss" in r:
        parts.append(f"eval_loss {r['eval_loss']:.4f} (ppl {r['eval_perplexity']:.2f})")
    if "step_time_s" in r and r["step"] < total_steps:
        parts.append(f"ETA {duration((total_steps - r['step']) * r['step_time_s'])}")
    return " | ".join(parts)
