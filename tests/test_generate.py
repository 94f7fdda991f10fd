"""Generation with a KV cache: greedy decoding equals the argmax of the full-sequence logits at
every step (on one device and on tensor 4), sampling is a function of the seed, and the
command answers bad input with one line."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spmd3d import generate
from spmd3d.generate import __main__ as generate_command
from spmd3d.step import make_logits_fn

PROMPTS = [[5, 17, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny LLaMA whose attention matters (large weights): a cache that dropped or misplaced
    keys would change what it predicts."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                      rope_theta=10000.0, initializer_range=0.3)
    path = tmp_path_factory.mktemp("gen")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[1, 4], ids=["one_device", "tensor4"])
def loaded(hf_dir, request):
    return generate.load(hf_dir, ["train.seq_len=40", f"mesh.tensor={request.param}"])


def test_greedy_equals_argmax_of_full_logits(loaded):
    plan, graphdef, params, _ = loaded
    assert plan.mesh.shape["tensor"] in (1, 4)
    out = generate.Generator(plan, graphdef, params).generate(PROMPTS, 24)
    assert [len(o) for o in out] == [24, 24, 24]
    assert len({tuple(o) for o in out}) == 3 and all(len(set(o)) > 3 for o in out), out
    logits = make_logits_fn(plan, graphdef, jax.tree.map(lambda x: x.sharding, params))
    for prompt, new in zip(PROMPTS, out):
        seq = np.array([prompt + new])
        full = np.asarray(logits(params, seq))[0]
        assert list(full[len(prompt) - 1:-1].argmax(-1)) == new


def test_sampling_is_a_function_of_the_seed(loaded):
    plan, graphdef, params, _ = loaded
    sample = generate.Generator(plan, graphdef, params, temperature=1.0, top_p=0.9)
    a, b, c = (sample.generate(PROMPTS, 12, seed=s) for s in (3, 3, 4))
    assert a == b and a != c
    # a row's draws depend on its index, not on the other rows
    assert sample.generate(PROMPTS[:1], 12, seed=3) == a[:1]
    # top_p so small that only the most likely token is left: greedy
    narrow = generate.Generator(plan, graphdef, params, temperature=1.0, top_p=1e-6)
    greedy = generate.Generator(plan, graphdef, params).generate(PROMPTS, 12)
    assert narrow.generate(PROMPTS, 12, seed=5) == greedy


def test_stops_at_eos_and_at_the_cache_end(loaded):
    plan, graphdef, params, _ = loaded
    gen = generate.Generator(plan, graphdef, params)
    full = gen.generate(PROMPTS, 100)
    assert [len(o) for o in full] == [40 - 9] * 3  # the longest prompt leaves 31 slots
    eos = full[0][4]
    stopped = gen.generate(PROMPTS, 20, stop=eos)
    assert stopped[0] == full[0][:full[0].index(eos) + 1]


def test_command_streams_the_continuation(hf_dir, capsys):
    assert generate_command.main([str(hf_dir), "--prompt", "def ", "--max-new", "8",
                          "train.seq_len=32", "mesh.simulated_devices=0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out.encode()) >= len("def ") + 1


@pytest.mark.parametrize("argv,blamed", [
    (["--prompt", "x" * 40], "--prompt"),
    ([], "--prompt"),
    (["--prompt", "x", "--temperature", "hot"], "--temperature"),
    (["--prompt", "x", "--top-p", "0"], "--top-p")])
def test_bad_input_is_one_line_and_exit_2(hf_dir, argv, blamed, capsys):
    assert generate_command.main([str(hf_dir), *argv, "train.seq_len=32",
                          "mesh.simulated_devices=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and blamed in err, err
