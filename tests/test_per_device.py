"""`manual.per_device`, the one way code runs per device over the mesh axes that split the
tokens (the loss, the lookup, the MoE layer, the Pallas kernel), and `manual.without`, the
rules inside such a map (the pipeline's too)."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd3d.manual import per_device, without
from spmd3d.sharding import Layout, compute_rules


def test_without_drops_the_manual_axes_from_every_name():
    rules = compute_rules(sequence_parallel=True, expert=True)
    inner = without(rules, ("data", "expert", "seq"))
    # the batch's two axes, the sequence's, and the experts' (its axis is the batch's)
    assert inner["batch"] is None and inner["length"] is None and inner["experts"] is None
    # sequence parallelism keeps its tensor half; the rest is as it was
    assert inner["res_length"] == "tensor" and inner["heads"] == "tensor"
    assert inner["layers"] == "stage" and without(rules, ()) == rules


def test_per_device_goes_manual_over_the_axes_that_split_tokens():
    mesh = jax.make_mesh((2, 1, 4), ("data", "seq", "tensor"))
    layout = Layout(compute_rules(), compute_rules(), mesh)
    shards = per_device(layout)
    assert shards.axes == shards.tokens == ("data",)  # seq is size 1: it splits nothing
    assert shards.spec(None) == P(("data",), None, None)
    assert shards.inner["batch"] is None and shards.inner["length"] == "seq"
    heads = per_device(layout, extra="kv_heads")
    assert heads.axes == ("data", "tensor") and heads.tokens == ("data",)
    assert heads.extra == ("tensor",) and heads.inner["heads"] is None
    # no layout (one device, a notebook): no map, the code runs as it is
    none = per_device(None)
    assert not none.axes and none(len, None, None) is len


def test_per_device_inside_another_map_keeps_its_axes_and_the_extra_automatic():
    mesh = jax.make_mesh((2, 1, 4), ("data", "seq", "tensor"))
    seen = {}

    def body(x):  # a pipeline's view: the data axis manual already, the rules without it
        inner = Layout(without(compute_rules(), ("data",)), compute_rules(), None)
        seen["shards"] = per_device(inner, x, extra="mlp")
        return x

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=jax.NamedSharding(mesh, P("data")))
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                 axis_names={"data"}), x)
    shards = seen["shards"]
    assert shards.axes == () and shards.tokens == ("data",) and shards.extra is None
