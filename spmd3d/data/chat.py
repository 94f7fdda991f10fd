"""Chat fine-tuning data: conversations rendered with the tokenizer's own chat template, trained
on the assistant's tokens alone, packed whole into windows.

The template is the `chat_template` of the tokenizer's `tokenizer_config.json` (a string, or
the one named `default` of a list), rendered as transformers' `apply_chat_template` renders it
and tokenized as it tokenizes (no special tokens added: the template writes them). A template
is code from whoever published the model, so it runs in Jinja's immutable sandbox: one that
reaches for Python's internals stops with one line.

The assistant's tokens are found by rendering: an assistant turn is the text between the
conversation up to it (with the generation prompt) and the conversation through it, so its
end-of-turn token is trained on too; a token is trained on (as a label) when it starts inside
an assistant turn. Windows (`pack`) hold whole examples, each followed by the end-of-text
token that separates documents; a token not to be trained on is stored as -(id + 1), so a
window stays one int32 row (`forward.labelled` reads it back), and the rest of a window is
end-of-text tokens that are not trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from ..schema import DataError

OPEN = 256  # windows kept open for first-fit packing: the rest are written out


def template(tokenizer_dir: str, field: str = "--tokenizer"):
    """(the compiled chat template, the special tokens it may use) of a HF model directory."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    directory = Path(tokenizer_dir).expanduser()
    directory = directory if directory.is_dir() else directory.parent
    config = directory / "tokenizer_config.json"
    found = json.loads(config.read_text()) if config.is_file() else {}
    source = found.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = {t.get("name"): t.get("template") for t in source}.get("default")
    if not source and (directory / "chat_template.jinja").is_file():
        source = (directory / "chat_template.jinja").read_text()
    if not source:
        raise DataError(field, f"{tokenizer_dir} has no chat template (tokenizer_config.json's "
                               "chat_template), which --chat needs")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
        x, ensure_ascii=False, indent=indent, **{k: v for k, v in kw.items()
                                                 if k in ("separators", "sort_keys")})
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        compiled = env.from_string(source)
    except jinja2.TemplateError as e:
        raise DataError(field, f"its chat template does not parse ({e})") from None

    def special(name):
        value = found.get(name)
        return value.get("content") if isinstance(value, dict) else value

    specials = {n: special(n) for n in ("bos_token", "eos_token", "unk_token", "pad_token")
                if special(n) is not None}
    return compiled, specials


def render(compiled, specials: dict, messages: list, where: str, prompt: bool = False) -> str:
    """The conversation as the template writes it; `prompt`: followed by the generation prompt."""
    import jinja2

    try:
        return compiled.render(messages=messages, add_generation_prompt=prompt, tools=None,
                               documents=None, **specials)
    except jinja2.exceptions.SecurityError as e:
        raise DataError(where, f"the chat template was stopped by the sandbox ({e})") from None
    except jinja2.TemplateError as e:
        raise DataError(where, f"the chat template failed ({e})") from None


def example(tok, compiled, specials: dict, messages, where: str) -> tuple[list, list]:
    """(token ids, whether each is trained on as a label) of one conversation."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages):
        raise DataError(where, "messages must be a list of {role, content}")
    text = render(compiled, specials, messages, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(compiled, specials, messages[:i], where, prompt=True)
        through = render(compiled, specials, messages[:i + 1], where)
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError(where, "the chat template does not write a conversation's start "
                                   "as the start of the whole, so its assistant turns cannot "
                                   "be found")
        spans.append((len(before), len(through)))
    if not spans:
        raise DataError(where, "the conversation has no assistant turn to train on")
    ids, offsets = tok.encode_offsets(text)
    starts = np.array([s for s, _ in offsets])
    trained = np.zeros(len(ids), bool)
    for a, b in spans:
        trained |= (starts >= a) & (starts < b)
    return ids, trained.tolist()


class Packer:
    """First-fit packing of examples into windows of `length` tokens: an example goes into the
    first open window with room, or a new one; past `OPEN` open windows, the fullest is
    written out. `eot`: the end-of-text id after each example and in the padding."""

    def __init__(self, length: int, eot: int, write):
        self.length, self.eot, self.write = length, eot, write
        self.open: list[list[int]] = []
        self.windows = 0

    def add(self, ids: list, trained: list):
        # an id trained on as a label stays; the others are -(id + 1); the end of text after
        # the example is trained on (the model learns where a conversation ends)
        row = [t if on else -t - 1 for t, on in zip(ids, trained)] + [self.eot]
        for window in self.open:
            if len(window) + len(row) <= self.length:
                window.extend(row)
                return
        self.open.append(row)
        if len(self.open) > OPEN:
            self._emit(max(range(len(self.open)), key=lambda i: len(self.open[i])))

    def _emit(self, i: int):
        window = self.open.pop(i)
        pad = [-self.eot - 1] * (self.length - len(window))
        self.write(np.asarray(window + pad, np.int32))
        self.windows += 1

    def close(self):
        while self.open:
            self._emit(0)
