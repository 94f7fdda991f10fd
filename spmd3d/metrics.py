"""Model FLOPs, MFU, and the run's metrics log (`metrics.jsonl` plus a terminal line)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls: every block weight and the output head."""
    d, h, k, f = cfg.d_model, cfg.dim_per_head, cfg.num_kv_heads, cfg.d_ff
    attn = d * (cfg.num_heads + 2 * k) * h + cfg.num_heads * h * d
    mlp = 3 * d * f
    return cfg.num_layers * (attn + mlp) + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's convention: 6 N + 12 L H Q T (fwd + bwd, no remat)."""
    return 6 * matmul_params(cfg) + 12 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * seq_len


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilization against the peak of all the devices used."""
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops


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

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def format_line(r: dict, total_steps: int) -> str:
    parts = [f"step {r['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {r['loss']:.4f}", f"grad_norm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}",
             f"{r['tokens_per_s']:,.0f} tok/s", f"{r['step_time_s']:.3f} s/step"]
    if not math.isnan(r.get("mfu", math.nan)):
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    return " | ".join(parts)
