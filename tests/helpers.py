"""Shared helpers: one small model, run on any layout of the 8 simulated devices."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import pickle
from pathlib import Path

import jax
import numpy as np
import pytest

from spmd3d import config
from spmd3d.runtime import setup
from spmd3d.step import make_grad_fn, make_train_step, reorder
from spmd3d.store import flat

# 16 query heads in 8 kv groups (GQA) so that tensor = 8 still splits whole groups.
SMALL = ["model.num_layers=2", "model.d_model=128", "model.num_heads=16", "model.num_kv_heads=8",
         "model.d_ff=256", "model.vocab_size=256", "train.global_batch=16", "train.seq_len=32",
         "train.steps=4", "optim.warmup_steps=2", "mesh.simulated_devices=0", "run.dir=unused"]


def small_config(data=1, stage=1, tensor=1, seq=1, zero=0, sp=False, micro=1, remat="none",
                 extra=()):
    return config.load(None, SMALL + [
        f"mesh.data={data}", f"mesh.stage={stage}", f"mesh.tensor={tensor}", f"mesh.seq={seq}",
        f"parallel.zero_stage={zero}", f"parallel.sequence_parallel={str(sp).lower()}",
        f"train.microbatches={micro}", f"parallel.remat={remat}", *extra])


def devices_for(cfg):
    return jax.devices()[: cfg.mesh.num_devices]


@functools.cache
def job_for(cfg):
    """One job per config for the whole session: a layout's loss and gradient tests share its
    setup and its compiled initializer, step and gradient function."""
    return setup(cfg, devices_for(cfg))


@functools.cache
def _grad_fn(cfg):
    job = job_for(cfg)
    return jax.jit(make_grad_fn(job.plan, job.graphdef))


_INITIAL = {}


def start_state(cfg):
    """The fresh state of `cfg` in its layout's shardings, placed from one host copy per model,
    optimizer and seed (made by a one-device initializer), not by compiling the layout's own
    initializer: `test_zero.test_every_layout_initializes_the_same_state` holds the two equal."""
    job = job_for(cfg)
    key = (cfg.model, cfg.optim, cfg.train.seed)
    if key not in _INITIAL:
        one = config.override(cfg, mesh=dict(data=1, stage=1, tensor=1, seq=1, expert=1,
                                             replicate=1),
                              parallel=dict(pipeline_repeats=1, zero_stage=0,
                                            sequence_parallel=False),
                              train=dict(microbatches=1))
        _INITIAL[key] = jax.device_get(setup(one, devices_for(one)).init_state())
    if job.plan.canonical_layers:
        return jax.device_put(_INITIAL[key], job.shardings)
    return job.reorder(jax.device_put(_INITIAL[key], job.canonical[1]), to_canonical=False)


def train_losses(cfg, steps=None):
    """Per-step losses of `steps` train steps from the fresh initial state."""
    job = job_for(cfg)
    state = start_state(cfg)
    losses = []
    for s in range(steps or cfg.train.steps):
        state, metrics = job.step_fn(state, job.global_batch(s))
        losses.append(float(metrics["loss"]))
    return np.array(losses), job, state


@functools.cache
def run_with_grads(cfg):
    """(per-step losses, (loss, gradients) at step 0) of `cfg.train.steps` train steps from the
    fresh state, all from one compiled step that also returns its gradients
    (`make_train_step(with_grads=True)`): a layout whose losses and gradients are both compared
    compiles once, not a step and a gradient function."""
    job = job_for(cfg)
    step = make_train_step(job.plan, job.graphdef, job.shardings, with_grads=True)
    state, losses, first = start_state(cfg), [], None
    for s in range(cfg.train.steps):
        state, metrics = step(state, job.global_batch(s))
        losses.append(float(metrics["loss"]))
        if first is None:
            grads = reorder(metrics["grads"], job.plan, to_canonical=True)
            first = (losses[0], {k: np.asarray(v) for k, v in flat(grads).items()})
    return np.array(losses), first


def first_grads(cfg):
    """(loss, {param path: gradient as numpy}) at the initial parameters on step 0's batch."""
    job = job_for(cfg)
    loss, grads = _grad_fn(cfg)(start_state(cfg).params, job.global_batch(0))
    grads = reorder(grads, job.plan, to_canonical=True)
    return float(loss), {k: np.asarray(v) for k, v in flat(grads).items()}


def by_layout(names):
    """Layout names as pytest parameters, each in an xdist group of its own name: a layout's
    loss, gradient and collective tests run in one worker, which then sets it up and compiles
    it once (`job_for`)."""
    return [pytest.param(n, marks=pytest.mark.xdist_group(n)) for n in names]


def max_rel_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@functools.cache
def reference_run(cfg):
    """(per-step losses, (loss, grads) at step 0) of `cfg` on one device: what layouts match,
    computed once per session whichever test module and whichever worker asks first (the
    others wait for it and read it from the session's shared directory)."""
    path = Path(os.environ["SPMD3D_TEST_SHARED"]) / (
        "reference-" + hashlib.sha1(repr(cfg).encode()).hexdigest() + ".pkl")
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            out = run_with_grads(cfg)
            path.write_bytes(pickle.dumps(out))
    return pickle.loads(path.read_bytes())


def assert_losses_match(cfg, ref_losses, grads_too=False):
    """`cfg` on all 8 devices gives the reference losses at every step (relative < 1e-4).
    `grads_too`: its gradients are compared as well (`assert_grads_match`), from the same
    compiled step."""
    assert job_for(cfg).mesh.size == 8
    losses = run_with_grads(cfg)[0] if grads_too else train_losses(cfg)[0]
    assert max_rel_diff(losses, ref_losses) < 1e-4, (losses, ref_losses)


def assert_grads_match(cfg, reference_grads, untrained=()):
    """Loss (relative 1e-5) and every gradient leaf (1e-5 of its largest value) at step 0;
    the `untrained` leaves' (an MoE router's bias) are zero in both."""
    ref_loss, ref_grads = reference_grads
    loss, grads = run_with_grads(cfg)[1]
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert grads.keys() == ref_grads.keys()
    for k, g in grads.items():
        r = ref_grads[k]
        if k in untrained:
            assert not np.any(g) and not np.any(r), k
            continue
        scale = np.max(np.abs(r))
        assert scale > 0, k
        assert np.max(np.abs(g - r)) <= 1e-5 * scale, (k, np.max(np.abs(g - r)), scale)


DOCS = {"a.txt": "def add(a, b):\n    return a + b\n", "sub/b.md": "# Title\n\nSome words here.\n",
        "sub/skip.bin": "not text"}


def bpe_dir(path, vocab=300):
    """A byte-level BPE like LLaMA 3's: a begin-of-text token added in front of every text,
    an end-of-text token named by tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|begin_of_text|>",
                                                                    "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(DOCS.values()) * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|end_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def env_without_devices(platform: bool = False) -> dict:
    """This interpreter's environment less the simulated-device count conftest sets (and
    JAX_PLATFORMS, with `platform`), for a process that must set its own devices; conftest's
    other XLA flags stay (LLVM's optimisation level)."""
    env = {k: v for k, v in os.environ.items() if not (platform and k == "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    return env
