"""AdamW with linear warm-up + cosine decay and global-norm clipping (optax).

The optimizer here is AdamW without its learning rate: the train step multiplies the update by
`lr_schedule(step)` itself, from the step count in the train state. So the optimizer state is
Adam's count and moments alone, and its checkpoint keys do not change with the schedule or with
clipping turned on or off (`optax.adamw` would add a schedule count of its own).

Weight decay applies to matrices only: a parameter is decayed when it has two or more dims
besides the stacked `layers` dim, so norm scales (stacked or not) are never decayed.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from .config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio`.
    Step 0 already uses the first warm-up increment (no wasted zero-lr step)."""
    decay = cfg.decay_steps or total_steps
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.warmup_steps else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(decay, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )
    return lambda count: base(count + 1)


def decay_mask(params):
    """True for matrices (>= 2 dims that are not `layers`), False for norm scales."""

    def is_matrix(v):
        return sum(name != "layers" for name in v.get_metadata("axes")) >= 2

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Clipping (unless `clip_norm` is 0), Adam, decoupled weight decay: `optax.adamw` up to
    its final scaling by -lr, which the step applies."""
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts += [optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
              optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask)]
    return optax.chain(*parts)
