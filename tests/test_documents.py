"""Packed documents: a window of several documents trains each one as if it were alone (its
tokens attend to their own document only; the prediction across an end of text is dropped),
in every attention kernel and layout, equal to one device."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import by_layout, bpe_dir, job_for, small_config, start_state
from spmd3d import config
from spmd3d.plan import Plan
from spmd3d.forward import labelled, loss_sum
from spmd3d.step import make_grad_fn
from spmd3d.store import flat

EOT = 3


def packed_batch(rows: int, length: int, seed: int = 0) -> np.ndarray:
    """[rows, length] tokens in 4..255 with an end of text after documents of 1 to 14 tokens
    (a window's last document runs on past its end)."""
    rng = np.random.default_rng(seed)
    out = rng.integers(4, 256, (rows, length))
    for r in range(rows):
        at = -1
        while (at := at + int(rng.integers(2, 16))) < length:
            out[r, at] = EOT
    return out.astype(np.int32)


def test_documents_and_their_labels():
    """Each input position's document id, and -1 for the label after an end of text and for
    a token stored as -(id + 1) (not trained on), which is read back as its id."""
    tokens = jnp.array([[5, 6, EOT, 7, EOT, EOT, -9, 9]])
    inputs, labels, segments = labelled(tokens, EOT)
    assert inputs.tolist() == [[5, 6, EOT, 7, EOT, EOT, 8]]
    assert segments.tolist() == [[0, 0, 0, 1, 1, 2, 3]]
    assert labels.tolist() == [[6, EOT, -1, EOT, -1, -1, 9]]
    assert labelled(tokens, None)[1].tolist() == [[6, EOT, 7, EOT, EOT, -1, 9]]


def _packed_plan(cfg, **kinds):
    job = job_for(cfg)
    return job, replace(job.plan, eot=EOT, **kinds)


def test_a_packed_window_trains_each_document_as_if_alone():
    """A window of four documents: its summed loss and its gradients are those of the four
    documents, each in a window of its own (at position 0: RoPE scores depend on relative
    positions only), summed; without the mask they are not."""
    cfg = small_config()
    job, plan = _packed_plan(cfg)
    params = start_state(cfg).params
    lengths = [9, 12, 5]  # each ends with its end of text; the last document has none
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(4, 256, n - 1), EOT) for n in lengths]
    docs.append(rng.integers(4, 256, cfg.train.seq_len + 1 - sum(lengths)))
    window = np.concatenate(docs)[None].astype(np.int32)

    def summed(plan, tokens):  # jitted: op by op, each shape's every op compiled alone
        return jax.jit(jax.value_and_grad(lambda p, t: loss_sum(plan, job.graphdef, p, t)[0]))(
            params, tokens)

    def alone_in_a_window(doc):  # padded after its end with tokens stored as not trained on
        # (-(id + 1)): causal, so the document's positions see none of them; one shape, so
        # the four documents and the unmasked window share one compiled function
        pad = np.full(window.shape[1] - len(doc), -(EOT + 1))
        return jnp.asarray(np.append(doc, pad)[None].astype(np.int32))

    packed_loss, packed = summed(plan, jnp.asarray(window))
    alone = [summed(job.plan, alone_in_a_window(d)) for d in docs]
    loss = sum(a[0] for a in alone)
    grads = jax.tree.map(lambda *g: sum(g), *[a[1] for a in alone])
    assert abs(float(packed_loss) - float(loss)) <= 1e-5 * abs(float(loss))
    for k, g in flat(packed).items():
        r = np.asarray(flat(grads)[k])
        assert np.max(np.abs(np.asarray(g) - r)) <= 1e-5 * np.max(np.abs(r)), k
    unmasked = summed(job.plan, jnp.asarray(window))[0]
    assert abs(float(unmasked) - float(loss)) > 1e-3 * abs(float(loss))


LAYOUTS = {
    "dp2_tp4_sp": dict(data=2, tensor=4, sp=True),
    "dp4_ring2": dict(data=4, seq=2),
    "dp2_ring4": dict(data=2, seq=4),
    "dp2_tp2_ring2_micro2": dict(data=2, tensor=2, seq=2, micro=2),
    "pp2_gpipe_dp2_tp2": dict(stage=2, data=2, tensor=2, micro=4),
    "pp2_1f1b_ring2_dp2": dict(stage=2, seq=2, data=2, micro=4,
                               extra=("parallel.pipeline_schedule=1f1b",)),
    "pp2_zb_h1_gather2_dp2": dict(stage=2, seq=2, data=2, micro=4,
                                  extra=("parallel.pipeline_schedule=zb_h1",)),
    "dp2_ulysses4": dict(data=2, seq=4, extra=("parallel.context=ulysses",)),
}


def _loss_and_grads(cfg, batch, **kinds):
    job, plan = _packed_plan(cfg, **kinds)
    loss, grads = jax.jit(make_grad_fn(plan, job.graphdef))(start_state(cfg).params,
                                                           jnp.asarray(batch))
    return float(loss), {k: np.asarray(v) for k, v in flat(grads).items()}


@pytest.mark.parametrize("name", by_layout(list(LAYOUTS)))
def test_packed_documents_on_8_devices_equal_one(name):
    """The mean loss over the trained labels and every gradient of a batch of packed windows
    on 8 devices (blocked attention with tensor and SP; the zig-zag ring over 2 and 4; with
    accumulation; through GPipe, 1F1B with the ring and ZB-H1 with all-gathered K/V; Ulysses
    over 4, the ids gathered) equal one device's (1e-5)."""
    cfg = small_config(**LAYOUTS[name])
    batch = packed_batch(cfg.train.global_batch, cfg.train.seq_len + 1)
    ref_loss, ref = _loss_and_grads(small_config(), batch)
    loss, grads = _loss_and_grads(cfg, batch)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    for k, g in grads.items():
        assert np.max(np.abs(g - ref[k])) <= 1e-5 * np.max(np.abs(ref[k])), k


@pytest.mark.parametrize("name", by_layout(["dp2_tp4_sp", "dp4_tp2_micro2"]))
def test_the_pallas_kernel_with_packed_documents_on_8_devices_equals_one(name, monkeypatch):
    """The GPU's kernel for packed documents (`pallas`, through Pallas's interpreter), per
    device over the batch and heads, accumulating microbatches too, gives one device's loss
    and gradients (1e-5); its per-device map adds no collective."""
    from spmd3d import attention, hlo

    monkeypatch.setattr(attention, "INTERPRET", True)
    cfg = small_config(**LAYOUTS.get(name, dict(data=4, tensor=2, micro=2)))
    batch = packed_batch(cfg.train.global_batch, cfg.train.seq_len + 1)
    ref_loss, ref = _loss_and_grads(small_config(), batch)
    loss, grads = _loss_and_grads(cfg, batch, attention="pallas")
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    for k, g in grads.items():
        assert np.max(np.abs(g - ref[k])) <= 1e-5 * np.max(np.abs(ref[k])), k
    job = job_for(cfg)
    collectives = {}
    for kind in ("pallas", "blocked"):
        plan = _packed_plan(cfg, attention=kind)[1]
        step = jax.jit(make_grad_fn(plan, job.graphdef))
        text = step.lower(start_state(cfg).params, jnp.asarray(batch)).compile().as_text()
        collectives[kind] = hlo.bytes_by_axes(hlo.collectives(text, plan.mesh.shape))
    assert collectives["pallas"] == collectives["blocked"]


def test_the_plan_masks_documents_where_the_tokenizer_ends_them(tmp_path):
    """On by default where the tokenizer has an end-of-text id (through a pipeline too), not
    with bytes, not when turned off."""
    tok = str(bpe_dir(tmp_path / "tok"))

    def plan(*extra, devices=1):
        cfg = config.load(None, ["model.vocab_size=300", "mesh.simulated_devices=0",
                                 "mesh.tensor=1", "mesh.seq=1", "mesh.data=-1", *extra])
        return Plan.resolve(cfg, jax.devices()[:devices])

    assert plan().eot is None
    masked = plan(f"data.tokenizer={tok}")
    assert masked.eot == 1 and "end of text: id 1" in masked.describe()
    assert plan(f"data.tokenizer={tok}", "data.document_mask=false").eot is None
    piped = plan("mesh.stage=2", "train.microbatches=2", f"data.tokenizer={tok}", devices=2)
    assert piped.eot == 1


def test_without_the_mask_the_loss_is_every_next_tokens_cross_entropy():
    """Masking off (the demo's bytes): the step's mean loss is the plain next-token
    cross-entropy of the model's own logits at every position, as before packed documents."""
    cfg = small_config()
    job = job_for(cfg)
    assert job.plan.eot is None
    params = start_state(cfg).params
    batch = packed_batch(4, cfg.train.seq_len + 1)
    loss = float(jax.jit(make_grad_fn(job.plan, job.graphdef))(params, jnp.asarray(batch))[0])
    from flax import nnx

    logits = nnx.merge(job.graphdef, params)(jnp.asarray(batch[:, :-1]))
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], axis=-1)
    assert abs(loss - float(jnp.mean(nll))) <= 1e-5 * loss
