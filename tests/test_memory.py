"""A step that cannot fit is refused before its first step; one that runs out of memory anyway
ends with one line and leaves the checkpoints as they were."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SMALL, small_config
from spmd3d import memory
from spmd3d.api import Experiment

ROOT = Path(__file__).resolve().parent.parent
# a tiny model, a batch of huge sequences: its activations need ~100 GB (the planner)
HUGE_SEQ = ["model.num_layers=1", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=4",
            "model.d_ff=128", "train.seq_len=65536", "train.global_batch=256", "mesh.data=1",
            "mesh.tensor=1"]


def train_command(run_dir, *overrides):
    return [sys.executable, "-m", "spmd3d.train", *SMALL, f"run.dir={run_dir}", *overrides]


def run(args, **env):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_step_that_cannot_fit_is_refused_in_one_line(tmp_path):
    """Exit 2 after compiling, nothing allocated (no checkpoint, no metrics), no traceback; the
    line names the largest kind and what to change. (No evaluation: at 65k tokens the corpus
    holds out too few windows, which the run says first, before compiling.)"""
    out = run(train_command(tmp_path / "run", "mesh.simulated_devices=1", *HUGE_SEQ,
                            "run.eval_every=0"))
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    line = lines[0]
    assert line.startswith("error: memory: this layout needs "), line
    assert "mostly activations at seq_len 65536" in line and "a device has" in line, line
    assert "mesh.seq" in line and "train.seq_len" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_check_in_the_api_and_its_switch():
    """`Experiment` raises the same error; `run.memory_check=false` compiles without it; a
    layout that fits passes and says what it needs."""
    huge = small_config(extra=HUGE_SEQ)
    with pytest.raises(memory.DoesNotFit, match="mostly activations"):
        Experiment(huge).compile()
    unchecked = small_config(extra=HUGE_SEQ + ["run.memory_check=false"])
    Experiment(unchecked).compile()  # compiles; allocates nothing
    fits = Experiment(small_config())
    fits.compile()
    need = fits.job.need
    assert 0 < need["total"] <= need["limit"] and need["limit_source"]


# `python -m spmd3d.train` whose compiled step raises XLA's out-of-memory error on its second
# call: what the loop sees when a device runs out of memory mid-run
OOM_AT_SECOND_STEP = """
import sys, jax
from spmd3d import runtime, train
real = runtime.Job.compile
def compile(self):
    compiled, seconds = real(self)
    calls = []
    def step(state, batch):
        calls.append(1)
        if len(calls) == 2:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes.")
        return compiled(state, batch)
    return step, seconds
runtime.Job.compile = compile
sys.exit(train.main(sys.argv[1:]))
"""


def tree_digest(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_out_of_memory_at_run_time_is_one_line_and_keeps_the_checkpoint(tmp_path):
    base = ["mesh.simulated_devices=2", "mesh.data=2", "mesh.tensor=1", "checkpoint.every=2"]
    first = run(train_command(tmp_path / "run", *base, "train.steps=2"))
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    before = tree_digest(checkpoints)
    assert before
    # the resumed run's second step (step 3) fails as a device out of memory would
    out = run([sys.executable, "-c", OOM_AT_SECOND_STEP, *SMALL, f"run.dir={tmp_path / 'run'}",
               *base, "train.steps=6"])
    assert out.returncode == 1, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[0].startswith("error: out of memory at step 3: the device could not allocate "
                               "68.7 GB; the compiled step needs "), lines[0]
    assert tree_digest(checkpoints) == before


@pytest.mark.parametrize("clip", [0.0, 0.5, 100.0])  # none, clipping, a norm under the limit
def test_clipped_adam_equals_optax(clip):
    """The fused clip + Adam transform gives optax's clip_by_global_norm + scale_by_adam
    updates and moments over three steps (float32 rounding)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from spmd3d.optim import scale_by_clipped_adam

    ref = optax.chain(*([optax.clip_by_global_norm(clip)] if clip else []),
                      optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8))
    new = scale_by_clipped_adam(clip, 0.9, 0.95, 1e-8)
    params = {"w": jnp.ones((4, 5)), "norm": {"scale": jnp.ones(7)}}
    ref_state, new_state = ref.init(params), new.init(params)
    for i in range(3):
        grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(i), x.shape), params)
        want, ref_state = ref.update(grads, ref_state, params)
        got, new_state = new.update(grads, new_state, params)
        for a, b in zip(jax.tree.leaves((want, ref_state[-1])), jax.tree.leaves((got, new_state))):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-12)


def test_bf16_moments_halve_the_state_and_follow_fp32s():
    """optim.moment_dtype=bfloat16: the two moments kept in bf16 (half the optimizer state),
    the update computed in fp32 from them, within bf16's rounding of the fp32 moments' over
    three steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from spmd3d.optim import scale_by_clipped_adam

    params = {"w": jnp.ones((4, 5)), "norm": {"scale": jnp.ones(7)}}
    ref, new = (scale_by_clipped_adam(1.0, 0.9, 0.95, 1e-8, d) for d in (None, "bfloat16"))
    ref_state, new_state = ref.init(params), new.init(params)
    assert {a.dtype for a in jax.tree.leaves((new_state.mu, new_state.nu))} == {jnp.dtype("bfloat16")}
    for i in range(3):
        grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(i), x.shape), params)
        want, ref_state = ref.update(grads, ref_state, params)
        got, new_state = new.update(grads, new_state, params)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert b.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-2, atol=1e-3)


def test_clipping_keeps_no_copy_of_the_gradients():
    """Gradient clipping costs no gradient-sized buffer: 6 layers of d_model 1024 (63 MB of
    fp32 gradients a layer), one device, temporaries with clipping at most a quarter layer
    above those without. optax's clip_by_global_norm before scale_by_adam measured 188 MB
    above (XLA kept the clipped gradients, which both moments read)."""
    import jax

    from spmd3d import config, hlo, runtime

    def temporaries(clip):
        cfg = config.load(None, [
            "model.num_layers=6", "model.d_model=1024", "model.num_heads=8",
            "model.num_kv_heads=4", "model.d_ff=4096", "model.vocab_size=1024",
            "train.seq_len=256", "train.global_batch=1", "mesh.data=1", "mesh.tensor=1",
            "mesh.simulated_devices=0", "parallel.zero_stage=0", "parallel.remat=full",
            "model.dtype=float16", f"optim.clip_norm={clip}"])
        return hlo.memory(runtime.setup(cfg, jax.devices()[:1]).compile()[0])["temp_bytes"]

    layer_grads = (1024 * (8 + 2 * 4) * 128 + 8 * 128 * 1024 + 3 * 1024 * 4096) * 4
    assert temporaries(1.0) - temporaries(0) < layer_grads / 4
