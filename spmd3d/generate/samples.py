"""Samples a training run prints (`run.sample_every`): the model being trained, copied into
a tensor-parallel layout beside the training state and continued from `run.sample_prompt` by
`Generator`, with the command's sampling defaults."""

from __future__ import annotations

import math

from .. import config as config_lib
from ..schema import DataError
from . import SERVING, TEMPERATURE, TOP_P, Generator, cache_layout


class Samples:
    """Samples during training (`run.sample_every`): the parameters copied into a
    tensor-parallel layout on the same devices (rows of the batch over the rest, each the
    same prompt), continued by `run.sample_tokens` tokens. `fits(need)` says whether that copy
    fits beside the training state (the step's memory need, `memory.check`)."""

    def __init__(self, plan):
        import jax

        from ..model import abstract_model
        from ..pipeline import reorder_layers
        from ..plan import Plan
        from ..step import canonical_state
        from ..tokenizer import load as load_tokenizer

        cfg, devices = plan.cfg, list(plan.mesh.devices.flat)
        rows = len(devices) // cfg.mesh.tensor
        serving = config_lib.override(config_lib.load(None, SERVING, base=config_lib.to_dict(cfg)),
                                      mesh={"tensor": cfg.mesh.tensor, "data": rows},
                                      train={"global_batch": rows})
        self.plan = Plan.resolve(serving, devices)
        abstract, shardings = canonical_state(self.plan)
        m, t = cfg.model, cfg.mesh.tensor
        cache = sum(math.prod(shape) // (t if "kv_heads" in axes else 1)  # one row a device
                    for shape, axes in cache_layout(m, 1, cfg.train.seq_len)
                    ) * jax.numpy.dtype(m.dtype).itemsize
        self.bytes = sum(a.size * a.dtype.itemsize
                         for a in jax.tree.leaves(abstract.params)) // t + cache
        order = plan.layer_order
        self._copy = jax.jit(lambda p: reorder_layers(p, order, inverse=True),
                             out_shardings=shardings.params)
        self.tok, self.text = load_tokenizer(cfg.data.tokenizer), cfg.run.sample_prompt
        self.prompt = self.tok.encode(self.text)
        if not 0 < len(self.prompt) < cfg.train.seq_len:
            raise DataError("run.sample_prompt", f"{len(self.prompt)} tokens; it needs 1 to "
                                                 f"train.seq_len - 1 = {cfg.train.seq_len - 1}")
        self.rows, self.tokens = rows, cfg.run.sample_tokens
        self.gen = Generator(self.plan, abstract_model(cfg.model)[0], None, TEMPERATURE, TOP_P)

    def fits(self, need: dict | None) -> bool:
        return not need or need["arguments"] + self.bytes <= need["limit"]

    def __call__(self, params) -> str:
        """The prompt and its continuation by `params` (the training plan's layout)."""
        out = self.gen.generate([self.prompt] * self.rows, self.tokens, stop=self.tok.stop_ids,
                                params=self._copy(params))
        return self.text + self.tok.decode(out[0])
