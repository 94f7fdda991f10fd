"""Mixture-of-Experts routing against transformers' own routers and balancing loss: Mixtral's
and Qwen3-MoE's (with and without `norm_topk_prob`), on the same hidden states and router
weights."""

import jax.numpy as jnp
import numpy as np
import pytest

from spmd3d import moe

torch = pytest.importorskip("torch")
from transformers import MixtralConfig, Qwen3MoeConfig  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

T, D, E, K = 64, 16, 8, 2


def hf_router(kind: str, norm: bool):
    if kind == "mixtral":
        cfg = MixtralConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=K)
        router = modeling_mixtral.MixtralTopKRouter(cfg)
    else:
        cfg = Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=norm)
        router = modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(np.random.default_rng(0).normal(size=(E, D))
                                             .astype(np.float32)))
    return router


@pytest.mark.parametrize("kind,norm", [("mixtral", True), ("qwen3_moe", True),
                                       ("qwen3_moe", False)])
def test_routing_is_transformers(kind, norm):
    router = hf_router(kind, norm)
    x = np.random.default_rng(1).normal(size=(T, D)).astype(np.float32)
    with torch.no_grad():
        logits, scores, indices = router(torch.from_numpy(x))
    weights, experts = moe.route(jnp.asarray(logits.numpy()), K, renormalize=norm)
    np.testing.assert_array_equal(np.asarray(experts), indices.numpy())
    np.testing.assert_allclose(np.asarray(weights), scores.float().numpy(), rtol=1e-6)
    assert np.allclose(np.asarray(weights).sum(-1), 1.0) == norm
    # the Switch load-balancing loss as transformers computes it (before router_aux_loss_coef)
    ours = moe.load_balancing_loss(jnp.asarray(logits.numpy()), experts)
    theirs = modeling_mixtral.load_balancing_loss_func((logits,), E, K)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_bias_moves_the_choice_not_the_weights():
    """DeepSeek-V3's balancing bias: added for selection only."""
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(T, E)).astype(np.float32))
    bias = jnp.zeros((E,)).at[3].set(10.0)  # expert 3 chosen by every token
    weights, experts = moe.route(logits, K, renormalize=False, bias_e=bias)
    assert (np.asarray(experts)[:, 0] == 3).all()
    probs = np.array(jnp.exp(logits - jnp.max(logits, -1, keepdims=True)))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights)[:, 0], probs[:, 3], rtol=1e-6)
    assert float(moe.imbalance(experts, E)) == pytest.approx(E / K)  # 3 takes T of the 2T


def test_balancing_terms_at_their_bounds():
    """Even routing: loss k and imbalance 1; the same two experts for every token, one of them
    with all the probability: loss E; the z-loss of logits all c is (c + log E)^2."""
    even = jnp.zeros((E, E))
    experts = jnp.stack([jnp.arange(E), (jnp.arange(E) + 1) % E], axis=1)
    assert float(moe.load_balancing_loss(even, experts)) == pytest.approx(K)
    assert float(moe.imbalance(experts, E)) == pytest.approx(1.0)
    skewed = jnp.zeros((T, E)).at[:, 0].set(1e4).at[:, 1].set(5e3)
    _, chosen = moe.route(skewed, K)
    assert float(moe.load_balancing_loss(skewed, chosen)) == pytest.approx(E, rel=1e-4)
    assert float(moe.z_loss(jnp.full((T, E), 2.0))) == pytest.approx((2.0 + np.log(E)) ** 2)
