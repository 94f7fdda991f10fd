"""The README's fine-tuning walk-through, command by command, on a tiny random LLaMA with a
real (byte-level BPE) tokenizer: import -> prepare text -> train -> prepare conversations ->
fine-tune on them -> generate -> export, and the export loads in transformers (model and
tokenizer) with the trained weights."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from helpers import DOCS, bpe_dir
from test_chat import TALK, TEMPLATE
from spmd3d import checkpoint


def command(*argv, cwd):
    out = subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_import_train_generate_export(tmp_path):
    torch.manual_seed(0)
    hf = tmp_path / "tiny-llama"
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0))
    model.save_pretrained(hf)
    bpe_dir(hf)  # the tokenizer beside the weights, as on the Hub
    (hf / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()),
                                                "eos_token_id": 1, "bos_token_id": 0}))
    texts = tmp_path / "my_texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"{i}.py").write_text(DOCS["a.txt"].replace("add", f"add{i}") * 3)

    devices = ["mesh.simulated_devices=2", "mesh.data=1", "mesh.tensor=2"]
    command("spmd3d.convert", "import", "tiny-llama", "runs/tiny", *devices,
            "train.seq_len=32", "train.global_batch=4", "optim.lr=1e-3", cwd=tmp_path)
    command("spmd3d.data", "prepare", "my_texts", "runs/tiny/tokens.bin",
            "--tokenizer", "runs/tiny/hf", cwd=tmp_path)
    out = command("spmd3d.train", "runs/tiny/config.yaml", "data.path=runs/tiny/tokens.bin",
                  "train.steps=4", "run.eval_every=0", "run.sample_every=4", cwd=tmp_path)
    assert "resumed at step 0" in out and "sample at step 4:\ndef" in out
    # chat fine-tuning on conversations, through the model's chat template (an Instruct
    # model's tokenizer_config.json has one), trained on the assistant's turns alone
    config = tmp_path / "runs" / "tiny" / "hf" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "bos_token": "<|begin_of_text|>", "chat_template": TEMPLATE}))
    (tmp_path / "my_chats.jsonl").write_text("".join(json.dumps({"messages": t[:k]}) + "\n"
                                                     for k in (3, 5) for t in [TALK] * 3))
    command("spmd3d.data", "prepare", "--chat", "my_chats.jsonl", "runs/tiny/chat.npy",
            "--tokenizer", "runs/tiny/hf", "--seq-len", "255", cwd=tmp_path)
    out = command("spmd3d.train", "runs/tiny/config.yaml", "data.path=runs/tiny/chat.npy",
                  "train.seq_len=255", "train.steps=6", "run.eval_every=0", cwd=tmp_path)
    assert "resumed at step 4" in out
    out = command("spmd3d.generate", "runs/tiny", "--prompt", "def add", "--max-new", "6",
                  cwd=tmp_path)
    assert out.startswith("def add")
    command("spmd3d.convert", "export", "runs/tiny", "tiny-llama-tuned", cwd=tmp_path)

    tuned = LlamaForCausalLM.from_pretrained(tmp_path / "tiny-llama-tuned")
    trained, _ = checkpoint.load(tmp_path / "runs" / "tiny")
    w = tuned.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy()
    assert np.array_equal(w, np.asarray(trained["blocks"]["mlp"]["w_down"][1]).T)
    assert not torch.equal(tuned.state_dict()["lm_head.weight"],
                           model.state_dict()["lm_head.weight"])  # it trained
    tok = AutoTokenizer.from_pretrained(tmp_path / "tiny-llama-tuned")
    assert tok("def add(a, b):")["input_ids"][0] == 0  # begin-of-text, as spmd3d tokenized
