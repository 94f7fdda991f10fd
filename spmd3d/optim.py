"""AdamW with linear warm-up + cosine decay and global-norm clipping (optax).

The optimizer here is AdamW without its learning rate: the train step multiplies the update by
`lr_schedule(step)` itself, from the step count in the train state. So the optimizer state is
Adam's count and moments alone, and its checkpoint keys do not change with the schedule or with
clipping turned on or off (`optax.adamw` would add a schedule count of its own).

Weight decay applies to matrices only: a parameter is decayed when it has two or more dims
besides the stacked `layers` dim, so norm scales (stacked or not) are never decayed.

Clipping and Adam are one transform (`scale_by_clipped_adam`): the clip factor is a scalar
that each moment update multiplies in, so no clipped copy of the gradients ever exists. With
optax's `clip_by_global_norm` before `scale_by_adam`, XLA kept that copy (both moments read it):
one more fp32 gradient-sized buffer per device (`tests/test_memory.py`; docs/choices.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .config import OptimConfig
from .untrained import trainable


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


def scale_by_clipped_adam(clip_norm: float, b1: float, b2: float, eps: float,
                          moment_dtype: str | None = None) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm(clip_norm)` (none when 0) then `optax.scale_by_adam`, as one
    transform with Adam's state: each parameter's clipped gradient, moments and update are one
    elementwise expression (a fused loop), the clip factor a scalar inside it. The moments are
    kept in `moment_dtype` (None: the parameters'), the update computed in fp32 from them.

    `update(..., grad_norm=n)` takes the gradients' global norm as computed already: the
    step takes it from the summed gradients, before dividing them by the label count, so
    that the division stays inside this update's fused loop (read by a norm too, the divided
    gradients were a buffer of their own: +180 MB for 6 layers of d_model 1024 on jax 0.12)."""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def init(params):
        state = adam.init(params)
        if moment_dtype is None:
            return state
        cast = lambda tree: jax.tree.map(lambda a: a.astype(moment_dtype), tree)  # noqa: E731
        return state._replace(mu=cast(state.mu), nu=cast(state.nu))

    def update(grads, state, params=None, grad_norm=None):
        del params
        scale = 1.0
        if clip_norm > 0:  # optax's rule: unchanged below the threshold
            norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
            scale = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
        count = optax.safe_increment(state.count)
        fix1, fix2 = 1 - b1 ** count, 1 - b2 ** count  # bias corrections

        def one(g, mu, nu):
            kept = mu.dtype
            g = g * jnp.asarray(scale, g.dtype)
            # the step from the moments as kept (rounded): with 2-byte moments, one that read
            # the old ones again made XLA copy them (the new ones overwrite them in place)
            mu = ((1 - b1) * g + b1 * mu.astype(g.dtype)).astype(kept)
            nu = ((1 - b2) * (g * g) + b2 * nu.astype(g.dtype)).astype(kept)
            m, v = mu.astype(g.dtype), nu.astype(g.dtype)
            step = (m / fix1.astype(m.dtype)) / (jnp.sqrt(v / fix2.astype(v.dtype)) + eps)
            return step, mu, nu

        out = jax.tree.map(one, grads, state.mu, state.nu)
        steps, mu, nu = jax.tree.transpose(jax.tree.structure(grads),
                                           jax.tree.structure((0, 0, 0)), out)
        return steps, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(cfg: OptimConfig, params=None) -> optax.GradientTransformation:
    """Clipping (unless `clip_norm` is 0), Adam, decoupled weight decay: `optax.adamw` up to
    its final scaling by -lr, which the step applies. For a model with `Untrained` state (the
    MoE router's, FP8's scaling; `params` is any tree shaped as the parameters), the
    optimizer is masked to the trained leaves: no moments for the rest, whose updates the
    step makes itself."""
    moments = None if cfg.moment_dtype == "auto" else cfg.moment_dtype
    tx = optax.chain(scale_by_clipped_adam(cfg.clip_norm, cfg.b1, cfg.b2, cfg.eps, moments),
                     optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    if params is None:
        return tx
    mask = trainable(params)
    return tx if all(jax.tree.leaves(mask)) else optax.masked(tx, trainable)
