"""Mixture-of-Experts routing against transformers' own routers and balancing loss: Mixtral's
and Qwen3-MoE's (with and without `norm_topk_prob`), on the same hidden states and router
weights."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import small_config
from spmd3d import config, footprint, grouped, moe
from spmd3d import router as routing_lib
from spmd3d.plan import Plan

ROOT = Path(__file__).resolve().parents[1]

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
    weights, experts = routing_lib.route(jnp.asarray(logits.numpy()), routing_lib.Routing(K, norm))
    np.testing.assert_array_equal(np.asarray(experts), indices.numpy())
    np.testing.assert_allclose(np.asarray(weights), scores.float().numpy(), rtol=1e-6)
    assert np.allclose(np.asarray(weights).sum(-1), 1.0) == norm
    # the Switch load-balancing loss as transformers computes it (before router_aux_loss_coef)
    ours = routing_lib.load_balancing_loss(jnp.asarray(logits.numpy()), experts)
    theirs = modeling_mixtral.load_balancing_loss_func((logits,), E, K)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


@pytest.mark.parametrize("groups,topk_groups,norm,scale", [(4, 2, True, 2.5), (8, 3, False, 1.0),
                                                         (1, 1, True, 1.0)])
def test_deepseek_v3_routing_is_transformers(groups, topk_groups, norm, scale):
    """Sigmoid scores, the correction bias for the choice alone (the groups' ranking too), the
    best `topk_group` of `n_group` groups by their two best scores, top-k inside them,
    renormalized when `norm_topk_prob`, times `routed_scaling_factor`: transformers'
    DeepseekV3TopkRouter on the same states, weights and bias."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    e, k = 32, 6
    cfg = DeepseekV3Config(hidden_size=D, n_routed_experts=e, num_experts_per_tok=k,
                           n_group=groups, topk_group=topk_groups, norm_topk_prob=norm,
                           routed_scaling_factor=scale)
    router = modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    rng = np.random.default_rng(5)
    bias = rng.normal(scale=0.1, size=(e,)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.normal(size=(e, D)).astype(np.float32)))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        x = rng.normal(size=(T, D)).astype(np.float32)
        logits, theirs, indices = router(torch.from_numpy(x))
    routing = routing_lib.Routing(k, norm, "sigmoid", groups, topk_groups, scale)
    weights, experts = routing_lib.route(jnp.asarray(logits.numpy()), routing, jnp.asarray(bias))
    # the same experts (transformers' top-k is unsorted) with the same weights each
    order = np.argsort(indices.numpy(), axis=-1)
    ours = np.argsort(np.asarray(experts), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), ours, -1),
                                  np.take_along_axis(indices.numpy(), order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), ours, -1),
                               np.take_along_axis(theirs.numpy(), order, -1), rtol=1e-6)
    if groups > 1:  # the limit bites: some token's best experts are not all chosen
        best = np.argsort(-(1 / (1 + np.exp(-logits.numpy())) + bias), axis=-1)[:, :k]
        assert (np.sort(best, -1) != np.sort(np.asarray(experts), -1)).any()


def test_bias_moves_the_choice_not_the_weights():
    """DeepSeek-V3's balancing bias: added for selection only."""
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(T, E)).astype(np.float32))
    bias = jnp.zeros((E,)).at[3].set(10.0)  # expert 3 chosen by every token
    weights, experts = routing_lib.route(logits, routing_lib.Routing(K, False), bias_e=bias)
    assert (np.asarray(experts)[:, 0] == 3).all()
    probs = np.array(jnp.exp(logits - jnp.max(logits, -1, keepdims=True)))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights)[:, 0], probs[:, 3], rtol=1e-6)
    assert float(routing_lib.imbalance(routing_lib.expert_load(experts, E))) == pytest.approx(E / K)  # 3 takes T of the 2T


def test_balancing_terms_at_their_bounds():
    """Even routing: loss k and imbalance 1; the same two experts for every token, one of them
    with all the probability: loss E; the z-loss of logits all c is (c + log E)^2."""
    even = jnp.zeros((E, E))
    experts = jnp.stack([jnp.arange(E), (jnp.arange(E) + 1) % E], axis=1)
    assert float(routing_lib.load_balancing_loss(even, experts)) == pytest.approx(K)
    assert float(routing_lib.imbalance(routing_lib.expert_load(experts, E))) == pytest.approx(1.0)
    skewed = jnp.zeros((T, E)).at[:, 0].set(1e4).at[:, 1].set(5e3)
    _, chosen = routing_lib.route(skewed, routing_lib.Routing(K))
    assert float(routing_lib.load_balancing_loss(skewed, chosen)) == pytest.approx(E, rel=1e-4)
    assert float(routing_lib.z_loss(jnp.full((T, E), 2.0))) == pytest.approx((2.0 + np.log(E)) ** 2)


# --------------------------------------------------------------------------- the layer's pieces
def _experts(seed: int, n: int = 12, d: int = 8, f: int = 6):
    """(n, d, tokens x[n, d], E experts' weights, and the tokens' top-K routing)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32))
    gate_up = jnp.asarray(rng.normal(size=(E, d, 2, f)).astype(np.float32))
    down = jnp.asarray(rng.normal(size=(E, f, d)).astype(np.float32))
    weights, experts = routing_lib.route(jnp.asarray(rng.normal(size=(n, E)).astype(np.float32)),
                                 routing_lib.Routing(K))
    return n, d, x, gate_up, down, weights, experts


def test_grouped_experts_equal_a_loop_over_experts():
    """Sorted by expert, two grouped matmuls, put back: each token's weighted sum of its
    experts' SwiGLU outputs, as a plain loop computes it; with the experts split in two
    halves (expert parallelism), the halves' outputs add up to the whole."""
    n, d, x, gate_up, down, weights, experts = _experts(3)
    want = np.zeros((n, d), np.float32)
    for t in range(n):
        for j in range(K):
            e = int(experts[t, j])
            h = np.asarray(x[t] @ gate_up[e, :, 0]), np.asarray(x[t] @ gate_up[e, :, 1])
            a = h[0] / (1 + np.exp(-h[0])) * h[1]
            want[t] += float(weights[t, j]) * (a @ np.asarray(down[e]))
    got = moe.grouped_ffn(x, gate_up, down, weights, experts)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    half = E // 2
    parts = [moe.grouped_ffn(x, gate_up[i * half:(i + 1) * half], down[i * half:(i + 1) * half],
                             weights, experts, first=i * half) for i in (0, 1)]
    np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), want, rtol=1e-5, atol=1e-5)
    # one expert per device: its buffers hold one row per token, not k (min(k, E_local))
    ones = [moe.grouped_ffn(x, gate_up[e:e + 1], down[e:e + 1], weights, experts, first=e)
            for e in range(E)]
    np.testing.assert_allclose(np.asarray(sum(ones)), want, rtol=1e-5, atol=1e-5)


def test_capacity_buffers_equal_dropless_with_room_and_drop_second_choices_first():
    n, d, x, gate_up, down, weights, experts = _experts(5)
    want = moe.grouped_ffn(x, gate_up, down, weights, experts)
    room = moe.capacity(E / K, n * K, E)  # the factor E / k: an expert could take every token
    slot, dropped = moe.slots(experts, 0, E, room)
    assert room == n and float(dropped) == 0.0
    got = moe.capacity_ffn(x, gate_up, down, weights, slot, room)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # every token's first choice expert 0, second expert 1..: one slot each keeps token 0's
    crowded = jnp.asarray([[0, 1 + t % (E - 1)] for t in range(n)], jnp.int32)
    slot, dropped = moe.slots(crowded, 0, E, 1)
    slot = np.asarray(slot)
    assert slot[0, 0] == 0 and (slot[1:, 0] == -1).all()  # expert 0: token 0 only
    assert float(dropped) == np.sum(slot == -1)
    # a second choice never takes a slot a first choice wanted: expert 1 is token 0's second
    # choice and token 7's too; token 0 (earlier) keeps it
    assert slot[0, 1] == 1 * 1 + 0 and slot[7, 1] == -1
    # with experts split in two, each half's slots are its own
    slot, _ = moe.slots(experts, E // 2, E // 2, room)
    assert ((np.asarray(slot) >= 0) == (np.asarray(experts) >= E // 2)).all()


def test_exchanged_capacity_buffers_drop_per_device_as_capacity_ffn_would():
    """The experts split over 4 devices, tokens moved by two all-to-alls: each device's
    output is `capacity_ffn` of its own tokens with every expert local and the same `cap`
    (an expert takes at most cap of each device's assignments), drops included."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    ep, n = 4, 12
    parts = [_experts(20 + i, n) for i in range(ep)]
    gate_up, down = parts[0][3], parts[0][4]  # the same experts on every device's copy
    x, weights, experts = (jnp.concatenate([p[i] for p in parts]) for i in (2, 5, 6))
    cap = 2  # below the busiest expert's share: some assignments drop
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])

    def local(x, gate_up, down, weights, experts):
        slot, dropped = moe.slots(experts, 0, E, cap)
        y = moe.capacity_ffn(x, gate_up, down, weights, slot, cap, "expert", ep)
        return y, jax.lax.psum(dropped, "expert")

    split = P("expert")
    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(split,) * 5, out_specs=(split, P())))
    args = [jax.device_put(a, NamedSharding(mesh, split))
            for a in (x, gate_up, down, weights, experts)]
    got, dropped = run(*args)
    want, want_dropped = [], 0.0
    for p in parts:
        slot, d = moe.slots(p[6], 0, E, cap)
        want.append(moe.capacity_ffn(p[2], gate_up, down, p[5], slot, cap))
        want_dropped += float(d)
    assert want_dropped > 0 and float(dropped) == want_dropped
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.concatenate(want)), rtol=1e-5,
                               atol=1e-5)


def _hand_objective(logits, experts, aux_weight, z_weight):
    """What `balanced` adds to the loss, written out for one microbatch on one device: aux
    weight x T x the balancing loss (the assignment shares held constant) + z weight x the
    tokens' summed squared log-sum-exp."""
    t, e = logits.shape
    share = routing_lib.expert_load(experts, e) / t
    probs = jax.nn.softmax(logits, axis=-1)
    aux = e * jnp.sum(share * jnp.mean(probs, axis=0))
    return aux_weight * t * aux + z_weight * jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)


def test_balancing_gradients_and_statistics_are_the_hand_computation():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(T, E)).astype(np.float32))
    cotangent = jnp.asarray(rng.normal(size=(T, E)).astype(np.float32))
    experts = routing_lib.choose(logits, routing_lib.Routing(K))
    how, probe = (0.01, 0.001, ()), jnp.zeros((routing_lib.stats_size(E),))
    g_logits, g_probe = jax.grad(lambda l, p: jnp.sum(
        routing_lib.balanced(l, p, experts, 0.0, how) * cotangent), (0, 1))(logits, probe)
    want = cotangent + jax.grad(_hand_objective)(logits, experts, 0.01, 0.001)
    np.testing.assert_allclose(np.asarray(g_logits), np.asarray(want), rtol=1e-5, atol=1e-7)
    load = np.asarray(routing_lib.expert_load(experts, E))
    lse = np.asarray(jax.nn.logsumexp(logits, axis=-1))
    aux = float(routing_lib.load_balancing_loss(logits, experts))  # transformers' (test above)
    np.testing.assert_allclose(np.asarray(g_probe),
                               [*load, aux * T, float(np.sum(lse ** 2)), 0.0], rtol=1e-5)
    # a zero cotangent (a lockstep pipeline's bubble) gives zero, as a linear backward does
    g_logits, g_probe = jax.grad(lambda l, p: jnp.sum(
        routing_lib.balanced(l, p, experts, 0.0, how) * 0.0), (0, 1))(logits, probe)
    assert not np.any(np.asarray(g_logits)) and not np.any(np.asarray(g_probe))


def test_bias_rule_and_step_metrics_by_hand():
    loads = np.array([[4.0, 1.0, 2.0, 1.0], [2.0, 2.0, 2.0, 2.0]], np.float32) / 4  # per token
    stats = np.concatenate([loads, [[2.5, 7.0, 0.0], [1.5, 5.0, 0.0]]], axis=1)
    bias = routing_lib.update_bias(jnp.zeros((2, 4)), jnp.asarray(stats), 0.01)
    np.testing.assert_allclose(np.asarray(bias), [[-0.01, 0.01, 0.0, 0.01], [0, 0, 0, 0]])
    m = routing_lib.step_metrics(jnp.asarray(stats))
    assert float(m["moe_aux_loss"]) == pytest.approx(2.0)
    assert float(m["moe_z_loss"]) == pytest.approx(6.0)
    assert float(m["moe_imbalance"]) == pytest.approx(2.0)  # layer 0: 1.0 over a mean of 0.5
    assert float(m["moe_dropped"]) == 0.0
    # padding layers (uneven stages) are left out
    m = routing_lib.step_metrics(jnp.asarray(stats), active=(False, True))
    assert float(m["moe_imbalance"]) == pytest.approx(1.0)


def test_the_plan_picks_the_experts_kernel():
    """The grouped matmul is chosen once, in the plan: jax's ragged_dot on a CPU, jax's Mosaic
    GPU kernel on a Hopper GPU in a 2-byte dtype, tokamax's kernels on other GPUs (a plan
    without devices assumes it installed; with devices and without it, ragged_dot and a
    warning), the capacity path whenever a capacity factor is set; an explicit kernel that
    cannot run here is refused naming the field."""
    installed = importlib.util.find_spec("tokamax") is not None
    hopper = dict(platform="gpu", capability=9.0, capacity_factor=0)
    ampere = dict(platform="gpu", capability=8.0, capacity_factor=0)
    assert grouped.choose("auto", platform="cpu", capacity_factor=0) == ("ragged", "")
    assert grouped.choose("auto", **hopper) == ("mosaic", "")
    assert grouped.choose("auto", **hopper, dtype="float32")[0] != "mosaic"
    assert grouped.choose("auto", platform="gpu", capability=10.0, capacity_factor=0,
                          devices=False) == ("tokamax", "")  # Blackwell: not Hopper's kernel
    assert grouped.choose("auto", **ampere, devices=False) == ("tokamax", "")
    assert grouped.choose("auto", **ampere) == \
        (("tokamax", "") if installed else ("ragged", grouped.SLOW))
    assert grouped.choose("tokamax", platform="gpu", capacity_factor=1.25)[0] == "capacity"
    assert grouped.choose("ragged", **hopper) == ("ragged", "")
    if not installed:
        with pytest.raises(config.ConfigError, match="model.expert_kernel"):
            grouped.choose("tokamax", **ampere)
    with pytest.raises(config.ConfigError, match="model.expert_kernel"):
        grouped.choose("mosaic", **ampere)
    with grouped.standing_in():
        assert grouped.choose("tokamax", platform="cpu", capacity_factor=0) == ("tokamax", "")
        assert grouped.choose("mosaic", platform="cpu", capacity_factor=0) == ("mosaic", "")
    plan = Plan.resolve(config.load(str(ROOT / "configs" / "mixtral_8x22b.yaml")),
                        topology="dgx_h100_256")
    assert plan.experts == ("mosaic", "") and plan.cfg.model.expert_kernel == "mosaic"
    assert plan.cfg.model.expert_weight_grad == "pallas"
    assert "experts: mosaic (dropless, weight gradient pallas)" in plan.describe()


def test_the_compile_stand_in_has_the_kernels_shapes():
    """What `plan --compile` compiles for tokamax on a CPU: the grouped matmul's output and
    both gradients with ragged_dot's shapes and dtypes (its buffers)."""
    x = jax.ShapeDtypeStruct((96, D), jnp.float16)
    w = jax.ShapeDtypeStruct((E, D, 24), jnp.float16)
    sizes = jax.ShapeDtypeStruct((E,), jnp.int32)

    def shapes(fn, w=w):
        def both(x, w, sizes):
            y, back = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
            return y, back(y)
        return jax.tree.map(lambda a: (a.shape, a.dtype), jax.eval_shape(both, x, w, sizes))

    with grouped.standing_in():
        for kernel, weight_grad in (("tokamax", "xla"), ("mosaic", "pallas"),
                                    ("ragged", "pallas")):
            assert grouped.matmul(kernel, weight_grad) is not jax.lax.ragged_dot
            assert shapes(grouped.matmul(kernel, weight_grad)) == shapes(jax.lax.ragged_dot)
            # and with the gate and up halves as a pair axis (`moe.grouped_ffn`'s)
            pair = jax.ShapeDtypeStruct((E, D, 2, 24), jnp.float16)
            assert shapes(grouped.matmul(kernel, weight_grad), pair) == shapes(
                lambda x, w, s: jnp.stack([jax.lax.ragged_dot(x, w[:, :, c], s) for c in (0, 1)],
                                          1), pair)


def test_the_experts_backward_keeps_their_weights_not_a_copy():
    """The layer hands its backward the experts' weights as given: the grouped matmul takes the
    gate and up halves as one weight with a pair axis. Sliced in the layer, each half was a new
    value that autodiff kept, a copy of the experts' gate and up weights in every stashed 1F1B
    pass and every scanned layer. Read from the layer's traced vjp (`residuals.of`): what it
    hands over that it made and that does not grow with the tokens."""
    from spmd3d.plan import residuals

    plan = Plan.resolve(small_config(data=8, extra=["mesh.expert=2", "model.num_experts=8",
                                                    "model.experts_per_token=2"]),
                        topology="cpu")
    m = plan.cfg.model
    gate_up = m.num_experts // 2 * m.d_model * 2 * m.expert_width * jnp.dtype(m.dtype).itemsize
    assert residuals.of(plan).fixed["none"] < gate_up / 10


@pytest.mark.parametrize("expert,capacity", [(2, 0), (2, 1.25), (1, 1.25)],
                         ids=["dropless", "exchanged", "capacity"])
def test_the_scan_of_layers_keeps_no_copy_of_the_experts_weights(expert, capacity):
    """Without a pipeline, with nothing recomputed: the only arrays shaped like the experts'
    weights that leave the step's scans of layers are their gradients, dropless or in
    capacity buffers, the experts split or not. The MoE layer's shard_map handed out the
    weights cast to varying over the tokens' axes, which the matmuls kept for their backward,
    and the scan stacked them: a copy of every layer's expert weights (4.8 GB of a step at
    Qwen3-30B's widths); the matmul now casts them itself (`grouped.matmul`'s `prepare`)."""
    from helpers import job_for
    from spmd3d.step import make_grad_fn

    cfg = small_config(data=8, extra=[f"mesh.expert={expert}", "model.num_experts=8",
                                      "model.experts_per_token=2", "model.d_ff_expert=96",
                                      f"model.capacity_factor={capacity}"])
    job = job_for(cfg)
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32)
    with jax.set_mesh(job.plan.mesh):
        jaxpr = jax.make_jaxpr(make_grad_fn(job.plan, job.graphdef))(job.abstract.params, tokens)
    d, f = cfg.model.d_model, cfg.model.expert_width

    def scanned(jx):  # the outputs of every scan, at any depth
        for e in jx.eqns:
            if e.primitive.name == "scan":
                yield from (v.aval.shape for v in e.outvars)
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else [p]):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from scanned(sub)

    shaped = [s for s in scanned(jaxpr.jaxpr) if s[-3:] == (d, 2, f) or s[-2:] == (f, d)]
    assert len(shaped) == 2, shaped  # the gate and up weights' gradient, the down weights'


def _poisoning_tokamax(monkeypatch):
    """A stand-in for tokamax as measured on an H200: exact in the groups, NaN in the rows past
    them (forward and input gradient), a weight gradient of its own (its Hopper one is wrong,
    so it must not be called)."""
    import sys
    import types

    def past(y, sizes):
        return jnp.where(jnp.arange(y.shape[0])[:, None] < jnp.sum(sizes), y, jnp.nan)

    fake = types.ModuleType("tokamax")
    fake.ragged_dot = lambda x, w, sizes: past(jax.lax.ragged_dot(x, w, sizes), sizes)

    def general(a, b, sizes, dims, **kw):
        assert dims.rhs_group_dimensions, "tokamax's weight gradient called"
        return past(jax.lax.ragged_dot_general(a, b, sizes, dims, **kw), sizes)

    fake.ragged_dot_general = general
    monkeypatch.setitem(sys.modules, "tokamax", fake)


def test_tokamax_rows_past_the_groups_are_masked_and_its_weight_gradient_is_xlas(monkeypatch):
    """The layer through tokamax, whose rows past the groups are undefined (up to 211 and NaN
    were measured) and whose weight gradient is wrong, equals ragged_dot's in value and every
    gradient, on a device holding half the experts (the other half's assignments are the rows
    past the groups)."""
    _poisoning_tokamax(monkeypatch)
    n, d, x, gate_up, down, weights, experts = _experts(3)
    half = E // 2
    ct = jax.random.normal(jax.random.key(9), (n, d))

    def grads(kernel):
        def loss(*args):
            return jnp.sum(moe.grouped_ffn(*args, experts, half, kernel) * ct)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(
            x, gate_up[half:], down[half:], weights)

    want, got = grads("ragged"), grads("tokamax")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    # the masks are what does it: without them tokamax's NaN get through
    monkeypatch.setattr(grouped, "_in_groups", lambda v, sizes: v)
    assert np.isnan(np.asarray(grads("tokamax")[0]))


def test_expert_weights_per_device_are_the_layouts_share():
    """Mixtral 8x22B at the seeds' layout: each device holds exactly all the experts' weights
    / (expert 8 x tensor 8 x stage 4), from the rules alone (what `plan --compile` reports
    beside the compiled memory)."""
    plan = Plan.resolve(config.load(str(ROOT / "configs" / "mixtral_8x22b.yaml")),
                        topology="dgx_h100_256")
    terms = footprint.state_terms(plan)
    assert terms["expert_weights"] * 8 * 8 * 4 == terms["expert_weights_total"]
    m = plan.cfg.model
    assert terms["expert_weights_total"] == 4 * m.num_layers * m.num_experts * 3 * m.d_model * \
        m.expert_width


def test_export_refuses_routing_no_transformers_family_holds():
    """Mixtral and Qwen3-MoE hold neither shared experts nor DeepSeek-V3's routing: the export
    refuses them in one line instead of writing a checkpoint that routes otherwise."""
    from dataclasses import replace

    from spmd3d import hf_config as hf
    base = config.load(None, ["model.num_experts=8"]).model
    hf.exportable(base)
    for change in (dict(shared_experts=1), dict(router_score="sigmoid"),
                   dict(router_groups=4, router_topk_groups=2), dict(router_scale=2.5)):
        with pytest.raises(hf.HFError, match="cannot be exported"):
            hf.exportable(replace(base, **change))
