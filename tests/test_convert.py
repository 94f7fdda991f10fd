"""Hugging Face interop against transformers itself: a tiny random LlamaForCausalLM (GQA,
head_dim != d_model / heads, non-default rope_theta, LLaMA 3.1 RoPE scaling, tied and untied)
imported, its logits compared with transformers', exported and reloaded by transformers."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spmd3d import checkpoint, config, convert, store
from spmd3d.convert import __main__ as convert_command
from spmd3d.model import abstract_model
from spmd3d.plan import Plan
from spmd3d.step import canonical_state, make_logits_fn

TOKENS = np.random.RandomState(0).randint(0, 256, (4, 24))
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_llama(tied: bool, rope_scaling=None) -> LlamaForCausalLM:
    torch.manual_seed(1 + tied)
    cfg = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                      rope_scaling=rope_scaling)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms away from 1, so that a mixed-up norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{variant: (transformers model, its saved directory, its logits on TOKENS)}."""
    out = {}
    for name, tied, rope in (("untied_llama3_rope", False, LLAMA3_ROPE), ("tied", True, None)):
        model, path = hf_llama(tied, rope), tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        with torch.no_grad():
            out[name] = (model, path, model(torch.tensor(TOKENS)).logits.numpy())
    return out


def run_config(hf_dir, mesh=None):
    mesh = mesh or dict(data=1, stage=1, tensor=1, seq=1)
    return convert.import_config(hf_dir, None, ["mesh.simulated_devices=0", "train.seq_len=24",
                                                "run.dir=unused",
                                                *(f"mesh.{k}={v}" for k, v in mesh.items())])


def ours_logits(cfg, params=None, hf_dir=None):
    """Logits of TOKENS on `cfg`'s mesh: `params` (canonical, any placement) or HF_DIR's."""
    plan = Plan.resolve(cfg, jax.devices()[:cfg.mesh.num_devices])
    abstract, shardings = canonical_state(plan)
    if params is None:
        params = convert.load_params(hf_dir, cfg, store.abstract_like(abstract, shardings).params)
    graphdef = abstract_model(plan.cfg.model)[0]
    return np.asarray(make_logits_fn(plan, graphdef, shardings.params)(params, TOKENS))


def assert_reloaded_equal(model, reloaded, ref):
    """Every tensor of the reloaded transformers model equal to the original's, and its logits
    on TOKENS equal to `ref`."""
    want, got = model.state_dict(), reloaded.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want
                                                             if not torch.equal(want[k], got[k])]
    with torch.no_grad():
        assert np.array_equal(reloaded(torch.tensor(TOKENS)).logits.numpy(), ref)


def saved_random(model, path):
    """(model, path, its logits on TOKENS): a tiny random transformers model in float32, its
    norms away from 1 (so that a mixed-up norm weight shows) and an MoE router's correction
    bias away from 0, saved to `path`."""
    model = model.float().eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                p.uniform_(-0.1, 0.1)
        model.save_pretrained(path)
        return model, path, model(torch.tensor(TOKENS)).logits.numpy()


def refused_import(hf_dir, tmp_path, capsys, change: dict, extra=()) -> str:
    """The one error line of `convert import` of a copy of HF_DIR whose config.json has
    `change`, after asserting it exits 2."""
    src = tmp_path / "hf"
    src.mkdir()
    for f in hf_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text()) | change
    (src / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert convert_command.main(["import", str(src), str(tmp_path / "run"),
                                 "mesh.simulated_devices=0", "mesh.tensor=1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def read_params(run_dir, cfg):
    arrays, _ = checkpoint.read(run_dir, lambda k: k.startswith("params/"))
    model = Plan.resolve(cfg, jax.devices()[:cfg.mesh.num_devices]).cfg.model  # dtype resolved
    return store.unflat(abstract_model(model)[1], {k[7:]: v for k, v in arrays.items()})


@pytest.mark.parametrize("variant", ["untied_llama3_rope", "tied"])
def test_import_gives_transformers_logits(models, variant, tmp_path):
    _, hf_dir, ref = models[variant]
    cfg = run_config(hf_dir)
    assert cfg.model.head_dim == 16 and cfg.model.num_kv_heads == 4
    assert cfg.model.rope_scaling == ("llama3" if "llama3" in variant else "none")
    convert.import_hf(hf_dir, tmp_path / "run", cfg, jax.devices()[:1])
    saved = config.load(str(tmp_path / "run" / "config.yaml"))
    assert saved.model == cfg.model and saved.run.dir == str(tmp_path / "run")
    assert (tmp_path / "run" / "hf" / "config.json").is_file()
    ours = ours_logits(cfg, read_params(tmp_path / "run", cfg))
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    # the one-device forward with scaling switched off differs: the scaling is exercised
    if "llama3" in variant:
        plain = config.override(cfg, model=dict(rope_scaling="none"))
        assert np.abs(ours_logits(plain, read_params(tmp_path / "run", cfg)) - ref).max() > 1e-3


def test_mistral_without_a_sliding_window_is_a_llama(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, sliding_window=None)).eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = model(torch.tensor(TOKENS)).logits.numpy()
    ours = ours_logits(run_config(tmp_path), hf_dir=tmp_path)
    assert np.abs(ours - ref).max() < 1e-4


@pytest.mark.parametrize("mesh", [dict(data=2, stage=1, tensor=4, seq=1),
                                  dict(data=1, stage=2, tensor=4, seq=1)],
                         ids=["data2_tensor4", "stage2_tensor4"])
def test_import_onto_a_mesh_gives_one_device_logits(models, mesh):
    _, hf_dir, ref = models["untied_llama3_rope"]
    one = ours_logits(run_config(hf_dir), hf_dir=hf_dir)
    many = ours_logits(run_config(hf_dir, mesh), hf_dir=hf_dir)
    assert np.abs(many - one).max() < 1e-5 and np.abs(many - ref).max() < 1e-4


@pytest.mark.parametrize("variant", ["untied_llama3_rope", "tied"])
def test_export_reloads_bit_equal_and_round_trips(models, variant, tmp_path):
    model, hf_dir, ref = models[variant]
    cfg = run_config(hf_dir)
    convert.import_hf(hf_dir, tmp_path / "run", cfg, jax.devices()[:1])
    # small files: several of them and the index transformers reads
    files = convert.export_hf(tmp_path / "run", tmp_path / "out", max_bytes=40_000)
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert_reloaded_equal(model, reloaded, ref)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["tie_word_embeddings"] is False and exported["head_dim"] == 16
    # export -> import is bit-exact
    convert.import_hf(tmp_path / "out", tmp_path / "again", run_config(tmp_path / "out"),
                      jax.devices()[:1])
    first, second = (store.flat(read_params(tmp_path / d, cfg)) for d in ("run", "again"))
    assert all(np.array_equal(first[k], second[k]) for k in first)
    # bfloat16 export: half the bytes, the values rounded
    convert.export_hf(tmp_path / "run", tmp_path / "bf16", dtype="bfloat16")
    half = LlamaForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.dtype == torch.bfloat16
    w = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(half.state_dict()[w], model.state_dict()[w].to(torch.bfloat16))


def _hf_dir(tmp_path, **changes):
    model = hf_llama(False)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("case,blamed", [
    ("missing", "HF_DIR"), ("gpt2", "model_type"), ("sliding", "sliding_window"),
    ("bias", "attention_bias"),
    ("longrope", "rope_scaling"), ("no_weights", "safetensors"), ("shape", "q_proj"),
    ("not_empty", "RUN_DIR"), ("bad_dtype", "--dtype")])
def test_bad_input_is_one_line_and_exit_2(case, blamed, tmp_path, capsys):
    src, dst, extra = tmp_path / "hf", tmp_path / "run", []
    if case == "gpt2":
        _hf_dir(src, model_type="gpt2")
    elif case == "sliding":
        _hf_dir(src, model_type="mistral", sliding_window=4096)
    elif case == "bias":
        _hf_dir(src, attention_bias=True)
    elif case == "longrope":
        _hf_dir(src, rope_scaling={"rope_type": "longrope", "factor": 4.0}, rope_parameters=None)
    elif case == "no_weights":
        _hf_dir(src)
        for f in src.glob("*.safetensors"):
            f.unlink()
    elif case == "shape":
        _hf_dir(src, num_key_value_heads=2)
        extra = ["mesh.simulated_devices=0", "mesh.tensor=1"]
    elif case == "not_empty":
        _hf_dir(src)
        (dst / "checkpoints" / "0").mkdir(parents=True)
        extra = ["mesh.simulated_devices=0", "mesh.tensor=1"]
    argv = ["import", str(src), str(dst), *extra]
    if case == "bad_dtype":
        dst.mkdir()
        argv = ["export", str(dst), str(tmp_path / "out"), "--dtype=int8"]
    capsys.readouterr()  # what saving the model printed
    assert convert_command.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and blamed in err, err
