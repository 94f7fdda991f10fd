"""The experts' weight-gradient kernel (tgmm.py) against its oracle, XLA's ragged_dot_general,
through Pallas's interpreter on the CPU: the same kernel that runs on a GPU, run one program at
a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd3d import grouped, moe, tgmm

# groups of 0, 1, 127, 128 and 129 rows (an empty one first and last), then 18 rows past them
SIZES = (0, 1, 127, 128, 129, 0)
ROWS = sum(SIZES) + 18


def _operands(dtype, d=64, f=96, seed=0):
    kx, kd = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (ROWS, d), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (ROWS, f), jnp.float32).astype(dtype)
    past = jnp.arange(ROWS)[:, None] >= sum(SIZES)
    # NaN past the groups: the rows of other devices' experts, which must not leak in
    return jnp.where(past, jnp.nan, x), jnp.where(past, jnp.nan, dy), past


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weight_gradient_equals_the_oracle(dtype):
    """Every group's x^T dy, 0 for the empty groups, no NaN from the rows past the groups.
    The kernel and the oracle multiply the same inputs and sum them in fp32 in different
    orders, so fp32 agrees to a few fp32 ulps of the sum (rtol 1e-5 over at most 129 terms);
    written as bf16 both round one fp32 value, so they differ by at most one bf16 ulp
    (2^-7 relative; checked as 2^-7 of the larger magnitude)."""
    x, dy, past = _operands(dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    got = tgmm.weight_gradient(x, dy, sizes, interpret=True)
    want = tgmm.reference(jnp.where(past, 0, x), jnp.where(past, 0, dy), sizes,
                          jnp.float32)
    assert got.shape == want.shape and got.dtype == dtype
    assert not np.isnan(np.asarray(got, np.float32)).any()
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert (got[0] == 0).all() and (got[-1] == 0).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert np.all(np.abs(got - want) <= 2.0 ** -7 * np.maximum(np.abs(want), 1e-30) +
                      2.0 ** -7 * np.abs(got))


def test_weight_gradient_at_shapes_that_do_not_divide_its_blocks():
    """Fewer rows than a block and widths that are not multiples of its tiles (padded)."""
    sizes = jnp.asarray([3, 0, 5], jnp.int32)
    x = jax.random.normal(jax.random.key(1), (9, 40))
    dy = jax.random.normal(jax.random.key(2), (9, 24))
    got = tgmm.weight_gradient(x, dy, sizes, interpret=True)
    want = tgmm.reference(x, dy, sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_plan_picks_the_weight_gradient():
    assert grouped.choose_weight_grad("auto", platform="gpu") == "pallas"
    assert grouped.choose_weight_grad("auto", platform="cpu") == "xla"
    assert grouped.choose_weight_grad("xla", platform="gpu") == "xla"


def test_the_layer_with_the_kernels_weight_gradient_equals_ragged_dot(monkeypatch):
    """An MoE layer's experts (gate/up and down, three grouped matmuls) on a device holding
    half of them, through ragged_dot with the weights' gradient from tgmm: the value and every
    gradient equal plain ragged_dot's autodiff."""
    monkeypatch.setattr(tgmm, "INTERPRET", True)
    e, n, d, f, k = 4, 24, 32, 48, 2
    keys = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(keys[0], (n, d))
    gate_up = jax.random.normal(keys[1], (e, d, 2, f)) / d ** 0.5
    down = jax.random.normal(keys[2], (e, f, d)) / f ** 0.5
    weights = jax.nn.softmax(jax.random.normal(keys[3], (n, k)), axis=-1)
    experts = jax.random.randint(keys[4], (n, k), 0, e)
    experts = jnp.where(experts[:, :1] == experts[:, 1:], jnp.stack(
        [experts[:, 0], (experts[:, 0] + 1) % e], 1), experts)
    ct = jax.random.normal(keys[5], (n, d))
    half = e // 2

    def grads(weight_grad):
        def loss(*args):
            return jnp.sum(moe.grouped_ffn(*args, experts, half, "ragged", weight_grad) * ct)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(
            x, gate_up[half:], down[half:], weights)

    want, got = grads("xla"), grads("pallas")
    assert grouped.matmul("ragged", "pallas") is not jax.lax.ragged_dot
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_the_kernel_comparison_runs_every_candidate_here():
    """`python -m spmd3d.microbench` (what launch/bench_gpu.sh runs first on a GPU) at a toy
    shape on the CPU: every candidate this machine has runs and matches XLA in fp32."""
    from spmd3d import microbench

    records = microbench.compare_grouped({"toy": (256, 64, 128, 4)}, dtype="float32")
    assert {r["op"] for r in records} == {"fwd", "dx", "dw"}
    assert any(r["kernel"].startswith("pallas") for r in records)
    ran = [r for r in records if "failed" not in r]
    assert ran and all(r["error"] < 1e-5 and not r["nan"] for r in ran)
    # a candidate fails on a CPU only where it needs a GPU (tokamax's kernels), never ours
    assert all(r["kernel"].startswith("tokamax") for r in records if "failed" in r)


def test_a_weight_gradient_that_does_not_exist_is_refused_naming_the_field():
    from spmd3d import config

    moe = ["model.num_experts=4", "model.experts_per_token=2", "mesh.tensor=1"]
    assert config.load(None, moe + ["model.expert_weight_grad=pallas"]).model.is_moe
    with pytest.raises(config.ConfigError, match="model.expert_weight_grad"):
        config.load(None, moe + ["model.expert_weight_grad=cuda"])
