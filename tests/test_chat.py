"""Chat fine-tuning data (`data prepare --chat`): the tokens transformers' apply_chat_template
gives, the loss on the assistant's tokens alone, whole examples packed into windows, and a
template or a conversation that cannot be used refused with one line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import bpe_dir, job_for, small_config, start_state
from spmd3d import data, tokenizer
from spmd3d.data import __main__ as prepare_cmd
from spmd3d.data import chat
from spmd3d.forward import labelled, loss_sum

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}"
            "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TALK = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def add(a, b)?"},
        {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "and sub?"},
        {"role": "assistant", "content": "return a - b"}]


def chat_tokenizer(path, template=TEMPLATE):
    bpe_dir(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(bos_token="<|begin_of_text|>", chat_template=template)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def write_jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def test_tokens_are_transformers_and_only_the_assistant_is_trained(tmp_path):
    """The rendered tokens equal transformers' apply_chat_template; the tokens trained on are
    the assistant's turns (their text and end-of-turn marker) and nothing else."""
    from transformers import AutoTokenizer

    tok_dir = chat_tokenizer(tmp_path / "tok")
    want = AutoTokenizer.from_pretrained(tok_dir).apply_chat_template(TALK, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    tok = tokenizer.load(str(tok_dir))
    ids, trained = chat.example(tok, *chat.template(str(tok_dir)), TALK, "x")
    assert ids == list(want)
    text = "".join(tok.decode([i]) for i, on in zip(ids, trained) if on)
    assert text == "return a + b<|end|>\nreturn a - b<|end|>\n"


def test_a_prompt_tokens_label_changes_nothing(tmp_path):
    """A window ending in a prompt token: changing that token (the last position's label, no
    one's input) leaves the loss as it was; ending in an assistant token, it does not."""
    cfg = small_config()
    job = job_for(cfg)
    params = start_state(cfg).params
    rng = np.random.default_rng(0)
    window = rng.integers(4, 256, (1, cfg.train.seq_len + 1)).astype(np.int32)

    summed = jax.jit(lambda p, t: loss_sum(job.plan, job.graphdef, p, t)[0])

    def loss(last):
        w = window.copy()
        w[0, -1] = last
        return float(summed(params, jnp.asarray(w)))

    assert loss(-(7 + 1)) == loss(-(90 + 1))  # a prompt token, stored as -(id + 1)
    assert loss(7) != loss(90)
    assert labelled(jnp.asarray([[5, -8, 9]]), None)[1].tolist() == [[-1, 9]]


def test_examples_are_packed_whole_first_fit(tmp_path):
    """Every conversation lands whole in one window, followed by the end of text; windows are
    filled first-fit and padded with end-of-text tokens not trained on; the loader reads the
    windows back as rows, flags and all."""
    tok_dir = chat_tokenizer(tmp_path / "tok")
    talks = [TALK[:3], TALK, TALK[1:3], TALK[:3], TALK[1:3]]
    write_jsonl(tmp_path / "talk.jsonl", talks)
    out = tmp_path / "chat.npy"
    assert prepare_cmd.main(["prepare", "--chat", "--seq-len=255", f"--tokenizer={tok_dir}",
                             str(tmp_path / "talk.jsonl"), str(out)]) == 0
    rows = np.load(out)
    assert rows.shape == (2, 256) and rows.dtype == np.int32  # 81 + 132 | 70 + 81 + 70
    tok = tokenizer.load(str(tok_dir))
    compiled, specials = chat.template(str(tok_dir))
    flat = rows.reshape(-1).tolist()
    for talk in talks:  # each example, flagged, then a (trained) end of text, in one window
        ids, on = chat.example(tok, compiled, specials, talk, "x")
        row = [t if f else -t - 1 for t, f in zip(ids, on)] + [tok.eos_id]
        assert any(r.tolist()[i:i + len(row)] == row for r in rows for i in range(256))
    assert sum(t == tok.eos_id for t in flat) == len(talks)  # padding is flagged
    assert sum(t == -tok.eos_id - 1 for t in flat) == rows.size - sum(
        len(chat.example(tok, compiled, specials, t, "x")[0]) + 1 for t in talks)
    # the same conversations as a Parquet column of lists of {role, content}: the same windows
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": talks}), tmp_path / "talk.parquet")
    assert prepare_cmd.main(["prepare", "--chat", "--seq-len=255", f"--tokenizer={tok_dir}",
                             str(tmp_path / "talk.parquet"), str(tmp_path / "pq.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "pq.npy"), rows)
    batches = data.TokenBatches(data.load_tokens(str(out)), 255, 0, tok.vocab_size)
    got = batches.batch(0, len(rows))
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, rows.tolist()))
    with pytest.raises(data.DataError, match="train.seq_len"):
        data.TokenBatches(data.load_tokens(str(out)), 32, 0, tok.vocab_size)


@pytest.mark.parametrize("case,blamed", [
    ("long", "talk.jsonl:2: the conversation is"),
    ("no_assistant", "talk.jsonl:2: the conversation has no assistant turn"),
    ("escape", "the chat template was stopped by the sandbox"),
    ("no_template", "--tokenizer"),
    ("bad_messages", "talk.jsonl:2: messages must be a list")])
def test_unusable_conversations_are_one_line_and_exit_2(case, blamed, tmp_path, capsys):
    """An example longer than a window (without --truncate), a conversation with no assistant
    turn, a template that reaches for Python's internals, a tokenizer without a template,
    messages that are not {role, content}: one line, exit 2, nothing written."""
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}" if case == "escape" else TEMPLATE
    tok_dir = chat_tokenizer(tmp_path / "tok", template)
    if case == "no_template":
        config = json.loads((tok_dir / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    second = {"long": TALK * 20, "no_assistant": TALK[:2], "bad_messages": "hello"}.get(case, TALK)
    write_jsonl(tmp_path / "talk.jsonl", [TALK[:3], second])
    out = tmp_path / "chat.npy"
    argv = ["prepare", "--chat", "--seq-len=255", f"--tokenizer={tok_dir}",
            str(tmp_path / "talk.jsonl"), str(out)]
    assert prepare_cmd.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and blamed in err and "\n" not in err, err
    assert not list(tmp_path.glob("chat.*"))
    if case == "long":  # cut to a window with --truncate
        assert prepare_cmd.main(argv + ["--truncate"]) == 0
        assert np.load(out).shape[1] == 256
