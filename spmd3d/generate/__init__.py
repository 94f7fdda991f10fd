"""Text from a trained run or a Hugging Face model (`python -m spmd3d.generate` is the command,
`__main__.py`).

Decoding with a KV cache: the prompts are run once (prefill, all positions at once, writing
every layer's keys and values into a cache of `train.seq_len` slots), then one token per step
(decode: one position per row, attending over the cache). Both are jitted once for the batch
and cache shapes, so a generation compiles two programs whatever its length. Rows may have
prompts of different lengths: each row's tokens go to its own positions, and a query at
position p sees cache slots 0..p only (`attention.cached_attention`), so the padding after a
short prompt is overwritten before anything reads it.

On one device by default, or sharded by the training rules (`mesh.tensor=4`: heads, MLP and
vocabulary split over 4 devices, the cache split by kv heads). Greedy (temperature 0) picks
the argmax; otherwise softmax(logits / T) restricted to the smallest set of tokens whose
probability reaches `top_p`, sampled from a key that is a function of `--seed`, the step and
the row. The command samples (T 0.7, top-p 0.9, seed 0) unless told otherwise, as do the
samples a training run prints: greedy decoding of a small model tends to repeat itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .. import config as config_lib
from ..schema import DataError

LOG = logging.getLogger("spmd3d")

TEMPERATURE, TOP_P = 0.7, 0.9  # the command's and the training samples' defaults
# the run's layout becomes one of plain tensor parallelism: no pipeline, ring or ZeRO
SERVING = ["mesh.data=1", "mesh.expert=1", "mesh.replicate=1", "mesh.stage=1", "mesh.tensor=1",
           "mesh.seq=1", "mesh.simulated_devices=-1", "parallel.zero_stage=0",
           "parallel.pipeline_repeats=1", "train.microbatches=1", "parallel.sequence_parallel=false", "train.global_batch=1"]


def _next_token(logits_bv, key, temperature: float, top_p: float):
    import jax
    import jax.numpy as jnp

    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits = logits_bv / temperature
    if top_p < 1:  # keep the most likely tokens until their probability reaches top_p
        desc = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(desc, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p  # the first always stays
        floor = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < floor, -jnp.inf, logits)
    # a key per row: a row's draws depend on the seed, the step and its index alone, not on
    # how many rows there are or how they are laid out
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(logits.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def cache_layout(m, batch: int, length: int) -> list:
    """[(shape, logical axes)] of a KV cache of `length` slots for model config `m`, one entry
    per array a layer keeps (`Ops.keep`), stacked over the layers: K and V [L, B, S, K, H],
    split by kv heads; with MLA the latent and the rotary key [L, B, S, C + R], whole on every
    tensor shard."""
    if m.is_mla:
        return [((m.num_layers, batch, length, m.kv_lora_rank + m.qk_rope_head_dim),
                 (None, "batch", None, None))]
    return [((m.num_layers, batch, length, m.num_kv_heads, width),
             (None, "batch", None, "kv_heads", "head_dim"))
            for width in (m.dim_per_head, m.value_dim)]


class Generator:
    """Prefill and decode for `plan` (its `train.seq_len` is the cache length), compiled once
    per batch size. `generate(prompts, ...)` returns the new tokens of every prompt."""

    def __init__(self, plan, graphdef, params, temperature: float = 0.0, top_p: float = 1.0):
        import jax

        self.plan, self.graphdef, self.params = plan, graphdef, params
        self.sampling = (float(temperature), float(top_p))
        self.cache_len = plan.cfg.train.seq_len
        # the new tokens replicated: every process reads them (several hosts), the cache stays
        out = tuple(self.plan.sharding(axes) for _, axes in self.layout(1)), self.plan.sharding(())
        self._prefill = jax.jit(self._prefill_fn, out_shardings=out)
        self._decode = jax.jit(self._decode_fn, donate_argnums=1, out_shardings=out)

    def layout(self, batch: int) -> list:
        """The cache's arrays (`cache_layout`) for `batch` rows."""
        return cache_layout(self.plan.cfg.model, batch, self.cache_len)

    def _forward(self, params, tokens_bt, positions_bt, cache):
        """Final activations [B, T, D] of tokens at positions[B, T], and the cache (`layout`)
        with what their attention keeps written."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from ..attention import cached_attention
        from ..ops import Ops
        from ..sharding import activation_rules, constrain

        with activation_rules(self.plan.rules.compute, self.plan.mesh):
            model = nnx.merge(self.graphdef, params)
            x = model.embed_tokens(tokens_bt)
            rope = model.rope(positions_bt)
            rows = jnp.arange(tokens_bt.shape[0])[:, None]

            def attend(q, k, v, scale=None):
                return cached_attention(q, k, v, positions_bt, scale)

            def run(x, stack, caches, n=1):  # a stack's layers, each with its rows of the cache
                # (an entry of n layers, `model.moe_every`: its layers' rows, in the order
                # they are written)
                block_def, arrays = nnx.graphdef(stack), len(caches)
                caches = [c.reshape(-1, n, *c.shape[1:])[:, j] for j in range(n) for c in caches]

                def layer(x, slot):
                    block, caches = slot
                    written = []

                    def keep(new):  # the layer's next cache array, these positions written
                        old = caches[len(written)]
                        written.append(old.at[rows, positions_bt].set(new.astype(old.dtype)))
                        return written[-1]

                    y = nnx.merge(block_def, block)(x, rope, Ops(attend, cache=keep))
                    return y, tuple(written)

                x, written = jax.lax.scan(layer, x, (nnx.state(stack), tuple(caches)))
                return x, [jnp.stack(written[a::arrays], 1).reshape(-1, *written[a].shape[1:])
                           for a in range(arrays)]

            # the dense layers before the main stack (if any) take the cache's first rows
            m, parts = self.plan.cfg.model, []
            k = m.dense_layers
            if model.dense is not None:
                x, written = run(x, model.dense, [c[:k] for c in cache])
                parts.append(written)
            x, written = run(x, model.blocks, [c[k:] for c in cache], m.moe_every)
            cache = [jnp.concatenate(p) for p in zip(*parts, written)]
            return x, tuple(constrain(c, axes) for c, (_, axes) in zip(cache, self.layout(1)))

    def empty_cache(self, batch: int):
        """The cache (`layout`) of zeros in the compute dtype."""
        import jax
        import jax.numpy as jnp

        dtype = self.plan.cfg.model.dtype
        return tuple(jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.plan.sharding(
            axes))() for shape, axes in self.layout(batch))  # in place, never whole on a device

    def _logits(self, params, x_b1d):
        from flax import nnx

        from ..sharding import activation_rules

        with activation_rules(self.plan.rules.compute, self.plan.mesh):
            return nnx.merge(self.graphdef, params).logits(x_b1d)[:, 0]

    def _prefill_fn(self, params, cache, tokens_bs, lengths_b, key):
        import jax.numpy as jnp

        b, s = tokens_bs.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        x, cache = self._forward(params, tokens_bs, positions, cache)
        last = x[jnp.arange(b), lengths_b - 1][:, None]
        return cache, _next_token(self._logits(params, last), key, *self.sampling)

    def _decode_fn(self, params, cache, token_b, position_b, key):
        x, cache = self._forward(params, token_b[:, None], position_b[:, None], cache)
        return cache, _next_token(self._logits(params, x), key, *self.sampling)

    def generate(self, prompts: list[list[int]], max_new: int, seed: int = 0,
                 stop=(), on_token=None, params=None) -> list[list[int]]:
        """New tokens of each prompt: `max_new` at most, fewer where the cache fills up, and a
        row stops after a token in `stop` (an id or several). `on_token(row tokens so far)` is
        called after each step; `params` (laid out as the generator's) replace its own."""
        import jax
        import numpy as np

        params = self.params if params is None else params
        stop = {stop} if isinstance(stop, int) else set(stop)

        longest, s = max(len(p) for p in prompts), self.cache_len
        if min(len(p) for p in prompts) == 0 or longest >= s:
            raise DataError("--prompt", f"a prompt has {longest if longest else 0} tokens; it "
                                        f"needs 1 to train.seq_len - 1 = {s - 1}")
        steps = min(max_new, s - longest)
        tokens = np.zeros((len(prompts), s), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        key = jax.random.key(seed)
        with jax.set_mesh(self.plan.mesh):
            cache, token = self._prefill(params, self.empty_cache(len(prompts)), tokens,
                                         lengths, jax.random.fold_in(key, 0))
            out = [[] for _ in prompts]
            done = np.zeros(len(prompts), bool)
            for step in range(steps):
                host = np.asarray(jax.device_get(token))
                for i, t in enumerate(host):
                    if not done[i]:
                        out[i].append(int(t))
                        done[i] = int(t) in stop
                if on_token:
                    on_token(out)
                if done.all() or step == steps - 1:
                    break
                cache, token = self._decode(params, cache, token, lengths + step,
                                            jax.random.fold_in(key, step + 1))
        return out


def load(source: str | Path, overrides=(), devices=None):
    """(plan, graphdef, params, tokenizer) of a run directory's newest checkpoint or of a HF
    model directory, laid out for generation (`SERVING`, then `overrides`)."""
    import jax

    from .. import checkpoint, store
    from ..model import abstract_model
    from ..plan import Plan
    from ..step import canonical_state
    from ..tokenizer import load as load_tokenizer

    source = Path(source)
    hf = (source / "config.json").is_file() and not (source / "checkpoints").is_dir()
    if hf:
        from ..convert import import_config

        cfg = import_config(source, None, [*SERVING, *overrides])
    else:
        saved = checkpoint.read_meta(source)["config"]
        cfg = config_lib.load(None, [*SERVING, *overrides], base=saved)
    plan = Plan.resolve(cfg, devices or jax.devices()[:cfg.mesh.num_devices])
    abstract, shardings = canonical_state(plan)
    target = store.abstract_like(abstract, shardings).params
    if hf:
        from ..convert import load_params

        params = load_params(source, cfg, target)
    else:
        wanted = {f"params/{k}": v for k, v in store.flat(target).items()}
        arrays, _ = checkpoint.read(source, list(wanted), target=lambda meta: wanted)
        params = store.unflat(target, {k[len("params/"):]: v for k, v in arrays.items()})
    tokenizer = cfg.data.tokenizer
    if tokenizer != "bytes" and not Path(tokenizer).exists() and (source / "hf").is_dir():
        tokenizer = str(source / "hf")  # a run started from another directory: its own copy
    return plan, abstract_model(plan.cfg.model)[0], params, load_tokenizer(tokenizer)
