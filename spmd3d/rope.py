"""Rotary position embeddings (RoPE), as transformers' LLaMA computes them, with LLaMA 3.1's
rescaling or YaRN's (DeepSeek-V3's long context)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .schema import ModelConfig


class Positions(NamedTuple):
    """What every layer shares about the positions it runs on: the RoPE tables cos/sin
    [1 or B, T, H/2] (fp32), and with packed documents each position's document id,
    segments[B, T] (None: a row is one document)."""

    cos: object
    sin: object
    segments: object = None


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The rotary frequencies [R/2] of the rotated part R of a head (fp32, numpy), computed as transformers' LLaMA does:
    1 / theta^(2i/H), and with `rope_scaling = llama3` LLaMA 3.1's rescaling (wavelengths
    longer than original_max_len / low_freq_factor slowed down by `rope_factor`, those shorter
    than original_max_len / high_freq_factor kept, a linear blend in between)."""
    h = cfg.rope_dim
    freq = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, h, 2, dtype=np.float32) / h)))
    if cfg.rope_scaling == "llama3":
        lo, hi, n = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
        wavelen = 2 * np.pi / freq
        slow = np.where(wavelen > n / lo, freq / cfg.rope_factor, freq)
        smooth = (n / wavelen - lo) / (hi - lo)
        blend = (1 - smooth) * slow / cfg.rope_factor + smooth * slow
        medium = ~(wavelen < n / hi) & ~(wavelen > n / lo)
        freq = np.where(medium, blend, slow)
    elif cfg.rope_scaling == "yarn":
        freq = _yarn(cfg, freq)
    return freq.astype(np.float32)


def _yarn(cfg: ModelConfig, freq: np.ndarray) -> np.ndarray:
    """YaRN's frequencies (transformers' `_compute_yarn_parameters`): each the interpolated
    (freq / factor) or kept one, blended by a ramp over the dims whose rotations within the
    original context lie between beta_slow and beta_fast."""
    r, base = cfg.rope_dim, np.float64(cfg.rope_theta)

    def dim_of(rotations):  # the dim whose wavelength fits `rotations` times in the context
        return r * np.log(cfg.rope_original_max_len / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low = max(np.floor(dim_of(cfg.rope_beta_fast)), 0)
    high = min(np.ceil(dim_of(cfg.rope_beta_slow)), r - 1)
    ramp = np.clip((np.arange(r // 2, dtype=np.float32) - low) / (high - low or 0.001), 0, 1)
    keep = 1 - ramp
    return (freq / cfg.rope_factor * (1 - keep) + freq * keep).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's m(s) = 0.1 s ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * float(np.log(factor)) + 1.0


def rope_gain(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return (yarn_mscale(cfg.rope_factor, cfg.rope_mscale)
                / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim))
    return yarn_mscale(cfg.rope_factor)


def rope_tables(positions_bt, freq):
    """cos/sin [B, T, H/2] in fp32 for integer positions [B, T] and frequencies [H/2].

    Static positions (numpy) give constant tables. Traced, XLA:CPU fuses cos and sin into
    every consumer and evaluates them once per element of q and k, forward and backward.
    """
    xp = np if isinstance(positions_bt, np.ndarray) else jnp
    angle = positions_bt.astype(xp.float32)[..., None] * freq
    return xp.cos(angle), xp.sin(angle)


def apply_rope(x, cos_bth, sin_bth):
    """Rotate pairs (first half, second half) of the last dim of x[B, T, ..., H]."""
    extra = x.ndim - 3  # head dims between T and H
    cos = cos_bth.reshape(cos_bth.shape[:2] + (1,) * extra + cos_bth.shape[2:])
    sin = sin_bth.reshape(sin_bth.shape[:2] + (1,) * extra + sin_bth.shape[2:])
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
