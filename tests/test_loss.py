"""The head and loss: chunked and vocab-parallel, equal to the plain cross-entropy.

(Equal to one device on 8 devices: the `chunked_loss` layouts of test_equivalence,
test_context and test_pipeline. Here: the arithmetic against a direct reference, and what it
saves in the compiled step.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import devices_for, small_config
from spmd3d import hlo, runtime
from spmd3d.config import ModelConfig
from spmd3d.model import Transformer
from spmd3d.vocab import head_logits, loss_chunks


@pytest.mark.parametrize("tokens,chunk,want", [
    (32, 0, 1), (32, 32, 1), (32, 8, 4), (32, 5, 8), (24, 7, 4), (24, 13, 2), (7, 2, 7),
    (8 * 8192, 1024, 64)])
def test_loss_chunks(tokens, chunk, want):
    assert loss_chunks(tokens, chunk) == want


def test_chunked_loss_equals_the_cross_entropy_and_ignores_padding():
    """Loss and gradients (activations, head, final norm) equal for every chunking, and equal
    to -log softmax at the label summed over labels >= 0 (padding, -1, counts for nothing)."""
    cfg = ModelConfig(d_model=32, vocab_size=96, num_heads=2, num_kv_heads=2, d_ff=64,
                      dtype="float32")
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(params=0)))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 24, 32)), jnp.float32)
    labels = rng.integers(0, 96, size=(3, 24))
    labels[1, 5:9] = -1
    labels = jnp.asarray(labels)

    def loss(params, x, chunk):
        return nnx.merge(graphdef, params).loss(x, labels, chunk)[0]

    model = nnx.merge(graphdef, params)
    logp = jax.nn.log_softmax(model.logits(x), axis=-1)
    direct = -np.sum(np.where(labels >= 0, np.take_along_axis(
        np.asarray(logp), np.maximum(np.asarray(labels), 0)[..., None], -1)[..., 0], 0))
    whole, whole_grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x, 0)
    np.testing.assert_allclose(whole, direct, rtol=1e-6)
    for chunk in (12, 8, 5, 1):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x, chunk)
        np.testing.assert_allclose(value, whole, rtol=1e-6)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(w))))


def compiled_loss(chunk):
    """The loss and its gradients alone, compiled on data 4 x tensor 2 (vocab split over
    tensor): 8 rows x 1024 positions, a vocabulary of 16384."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from spmd3d.sharding import activation_rules, compute_rules, shardings_for

    cfg = ModelConfig(d_model=128, vocab_size=16384, num_heads=2, num_kv_heads=2, d_ff=64,
                      dtype="float32")
    mesh = jax.make_mesh((4, 1, 2, 1), ("data", "stage", "tensor", "seq"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    rules = compute_rules()
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0))))

    def loss(params, x, labels):
        with activation_rules(rules, mesh):
            return nnx.merge(graphdef, params).loss(x, labels, chunk)[0]

    rows = NamedSharding(mesh, P("data"))
    shapes = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           params, shardings_for(params, rules, mesh)),
              jax.ShapeDtypeStruct((8, 1024, 128), jnp.float32, sharding=rows),
              jax.ShapeDtypeStruct((8, 1024), jnp.int32, sharding=rows))
    return jax.jit(jax.value_and_grad(loss)).lower(*shapes).compile()


def test_logits_exist_one_piece_at_a_time():
    """Per device: 2 rows x 1024 positions x 8192 vocab (tensor 2) fp32 logits are 64 MiB.
    Unchunked, the loss and its backward hold two arrays of that size at once; in pieces of
    256 tokens (8 MiB of logits each), a few pieces' worth. Vocab-parallel: nothing is
    all-gathered, per-token sums (and the input's gradient) are all-reduced over tensor per
    piece, and the head's gradient over data once, not once per piece."""
    logits = 2 * 1024 * 8192 * 4
    whole, chunked = compiled_loss(0), compiled_loss(256)
    t_whole, t_chunked = (hlo.memory(c)["temp_bytes"] for c in (whole, chunked))
    assert t_whole >= 2 * logits, t_whole
    assert t_chunked <= 3 * logits / 8, (t_chunked, t_whole)
    mesh = {"data": 4, "stage": 1, "tensor": 2, "seq": 1}
    colls = hlo.collectives(chunked.as_text(), mesh)
    assert not [x for x in colls if x.kind != "all-reduce"], colls
    assert {x.trips for x in colls if x.axes == ("tensor",)} == {8}, colls
    over_data = [x for x in colls if "data" in x.axes]
    assert over_data and all(x.trips == 1 for x in over_data), colls


def _dot_operand_types(fn, *args) -> list[tuple[str, str]]:
    """The element types of every matmul's two operands in the lowered gradient of `fn`."""
    text = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args).as_text()
    return re.findall(r"dot_general.*: \(tensor<[0-9x]*x(\w+)>, tensor<[0-9x]*x(\w+)>\)", text)


def test_head_backward_runs_in_the_compute_dtype():
    """fp32 compute: `head_logits`' gradients are autodiff's exactly. bf16: within bf16
    rounding of autodiff's, and every matmul of the backward takes bf16 operands, where
    autodiff's fp32 cotangent upcasts the [D, V] weights and runs both in fp32."""
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(64, 32)), rng.normal(size=(32, 96)) / 6

    def autodiff(x, w):
        return jnp.einsum("nd,dv->nv", x, w, preferred_element_type=jnp.float32)

    def loss(logits_fn):  # a loss whose cotangent is not a constant
        return lambda x, w: jnp.sum(jax.nn.logsumexp(logits_fn(x, w), axis=-1) ** 2)

    for dtype, rtol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
        args = (jnp.asarray(x, dtype), jnp.asarray(w, dtype))
        ours = jax.grad(loss(head_logits), argnums=(0, 1))(*args)
        ref = jax.grad(loss(autodiff), argnums=(0, 1))(*args)
        for a, b in zip(ours, ref):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), dtype
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    ours, ref = (_dot_operand_types(loss(f), *args) for f in (head_logits, autodiff))
    assert len(ours) == 3 and set(ours) == {("bf16", "bf16")}, ours
    assert ref.count(("f32", "f32")) == 2, ref  # what it replaces: both upcast to fp32


def _entry_graph(hlo_text: str):
    """({instruction: its operands}, {op_name: instruction} of the while loops) of the
    compiled module's entry computation."""
    entry = hlo_text[hlo_text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    operands, loops = {}, {}
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = .*?[\w\-]+\((.*)$", line)
        if m:
            operands[m[1]] = set(re.findall(r"%[\w.\-]+", m[2].split(", metadata=")[0]))
            if " while(" in line:
                loops[re.search(r'op_name="([^"]*)"', line)[1]] = m[1]
    return operands, loops


def test_the_loss_backward_starts_after_the_forward_loss_on_every_device():
    """The recomputed loss pieces' loop needs nothing of the forward loop by itself, and XLA
    gives the log-sum-exp's all-reduce in both the same channel: XLA:CPU then ran the two in
    either order per device, and devices waited on each other for good (1 run in 5, data 4 x
    tensor 2 in bf16; `vocab.backward_after`). The backward loop must read the forward's."""
    from helpers import job_for

    cfg = small_config(data=4, tensor=2, extra=["parallel.loss_chunk=32"])
    operands, loops = _entry_graph(job_for(cfg).compile()[0].as_text())
    forward = loops["jit(train_step)/jvp()/shard_map/while"]
    backward = loops["jit(train_step)/transpose(jvp())/shard_map/while"]
    seen, todo = set(), [backward]
    while todo:
        for o in operands.get(todo.pop(), ()):
            if o not in seen:
                seen.add(o)
                todo.append(o)
    assert forward in seen
