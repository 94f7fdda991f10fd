"""What a run trains and evaluates on, from its config: the windows of `data.path`, or of the
sources of `data.mixture` by weight, and the held-out windows beside them."""

from __future__ import annotations

from . import DataError, TokenBatches, held_out, load_tokens
from .mixture import Mixture
from ..parsing import parse_mixture


def training_data(cfg):
    """(the training windows, the held-out data or None) of a config: `data.path`, or the
    sources of `data.mixture` by weight (each with its own held-out part)."""
    t, d = cfg.train, cfg.data
    held = None
    if d.eval_path:
        try:
            held = load_tokens(d.eval_path, d.tokenizer)
        except DataError as e:
            raise DataError("data.eval_path", e.message) from None
    if not d.mixture:
        tokens = load_tokens(d.path, d.tokenizer)
        if held is None and d.eval_fraction:
            tokens, held = held_out(tokens, d.eval_fraction)
        return TokenBatches(tokens, t.seq_len, t.seed, cfg.model.vocab_size), held
    sources, weights, parts = [], [], []
    for i, (path, weight) in enumerate(parse_mixture(d.mixture)):
        try:
            tokens = load_tokens(path, d.tokenizer)
            if held is None and d.eval_fraction:
                tokens, part = held_out(tokens, d.eval_fraction)
                parts.append(part)
            sources.append(TokenBatches(tokens, t.seq_len, t.seed, cfg.model.vocab_size, i))
        except DataError as e:
            raise DataError("data.mixture", f"{path}: {e.message}") from None
        weights.append(weight)
    return Mixture(sources, weights, t.seed), held if held is not None else (
        (parts, weights) if parts else None)


def eval_batches(held, cfg):
    """The held-out windows: `run.eval_batches` global batches of distinct windows, always the
    same ones (the batches of steps 0, 1, ... of the held-out data); a mixture's (`held`:
    (each source's held-out part, the weights)) mixed as its training data is."""
    if isinstance(held, tuple):
        parts, weights = held
        t = cfg.train
        try:
            return Mixture([TokenBatches(p, t.seq_len, t.seed, cfg.model.vocab_size, i)
                            for i, p in enumerate(parts)], weights, t.seed)
        except DataError as e:
            raise DataError("data.eval_fraction", f"a mixture's held-out part: {e.message}")
    t, field = cfg.train, "data.eval_path" if cfg.data.eval_path else "data.eval_fraction"
    need = cfg.run.eval_batches * t.global_batch
    have = held.shape[0] if held.ndim == 2 else (held.shape[0] - 1) // t.seq_len if \
        held.shape[0] else 0
    if have < need:
        raise DataError(field, f"the held-out data has {have} windows of seq_len + 1 = "
                               f"{t.seq_len + 1} tokens; run.eval_batches = "
                               f"{cfg.run.eval_batches} batches of {t.global_batch} need {need} "
                               "(hold out more, or lower run.eval_batches)")
    return TokenBatches(held, t.seq_len, t.seed, cfg.model.vocab_size)
