"""The command line of every `python -m spmd3d.*` command: one parser, one `--help`, one error path.

An entry point declares a `Command` (its flags, each with a line of help) and ends in
`run(COMMAND, argv, body)`. Config commands take `[CONFIG.yaml] [key=value ...]`, and their
`--help` lists every config field from `config.field_docs()`, so the help cannot drift from the
dataclasses. Every user mistake is a `ConfigError`/`DataError` and becomes one `error:` line and
exit status 2. This module imports only the standard library, `config` and `schema`: `--help` and
bad arguments must answer at once, and the device count must be settable before jax starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Callable

from . import config as config_lib
from .config import ConfigError
from .schema import DataError
from .units import columns

KINDS = ("switch", "int", "str")


@dataclass(frozen=True)
class Flag:
    """`--name` (a switch: True when given) or `--name=VALUE` (int or str); an int < minimum is
    an error."""

    name: str
    kind: str = "switch"
    help: str = ""
    minimum: int | None = None

    def __post_init__(self):
        if not self.name.startswith("--") or self.kind not in KINDS:
            raise ValueError(f"bad flag {self!r}: name starts with --, kind is one of {KINDS}")

    @property
    def spelling(self) -> str:
        return self.name + {"switch": "", "int": "=N", "str": "=VALUE"}[self.kind]


@dataclass(frozen=True)
class Command:
    """One `python -m spmd3d.X` command. `usage` is what follows `prog`; `takes_config` picks
    `[CONFIG.yaml] [key=value ...]` (True) or plain positional arguments (False)."""

    prog: str
    usage: str
    description: str
    flags: tuple[Flag, ...] = ()
    takes_config: bool = True


@dataclass
class Args:
    """A parsed command line; `flags` maps a flag's name to True (switch) or its int/str value."""

    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    flags: dict[str, object] = field(default_factory=dict)
    positional: list[str] = field(default_factory=list)

    def load_config(self) -> config_lib.Config:
        """The validated config: CONFIG (a path, or a preset's name looked up in
        `--config-dir` and then among the shipped presets) <- the key=value overrides."""
        return config_lib.load(self.config, self.overrides, self.flags.get("--config-dir"))


def _is_flag(arg: str) -> bool:
    return arg.startswith("-") and arg != "-"


def parse_args(argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """Split `[CONFIG.yaml] [key=value ...] [--flags]` into (config path, overrides, raw flags)."""
    path, overrides, flags = None, [], []
    for a in argv:
        if _is_flag(a):
            flags.append(a)
        elif "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            raise ConfigError("argv", f"unexpected argument {a!r} (expected key=value)")
    return path, overrides, flags


def _known(command: Command) -> str:
    return ", ".join(f.spelling for f in _flags(command)) or "none"


def _flag_value(command: Command, arg: str) -> tuple[str, object]:
    name, eq, raw = arg.partition("=")
    flag = next((f for f in _flags(command) if f.name == name), None)
    if flag is None:
        raise ConfigError("argv", f"unknown flag {name} (known: {_known(command)})")
    if flag.kind == "switch":
        if eq:
            raise ConfigError("argv", f"{name} is a switch and takes no value, got {arg!r}")
        return name, True
    if not raw:
        raise ConfigError("argv", f"{name} needs a value: {flag.spelling}")
    if flag.kind == "str":
        return name, raw
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError("argv", f"{name} needs an integer, got {raw!r}") from None
    if flag.minimum is not None and value < flag.minimum:
        raise ConfigError("argv", f"{name} must be >= {flag.minimum}, got {value}")
    return name, value


# every command that takes a config: where presets named on the command line are looked up
CONFIG_DIR = Flag("--config-dir", kind="str",
                  help="look CONFIG up in DIR (DIR/CONFIG.yaml) before the shipped presets")


def _flags(command: Command) -> tuple[Flag, ...]:
    return command.flags + ((CONFIG_DIR,) if command.takes_config else ())


def _join_values(command: Command, argv: list[str]) -> list[str]:
    """`--name VALUE` as `--name=VALUE` for flags that take a value."""
    valued = {f.name for f in _flags(command) if f.kind != "switch"}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in valued and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parse(command: Command, argv: list[str]) -> Args:
    """argv -> Args, every flag checked against the command's flags; raises
    ConfigError('argv', ...)."""
    argv = _join_values(command, argv)
    rest = [a for a in argv if not _is_flag(a)]
    flags = dict(_flag_value(command, a) for a in argv if _is_flag(a))
    if not command.takes_config:
        return Args(flags=flags, positional=rest)
    path, overrides, _ = parse_args(rest)
    return Args(path, overrides, flags)


def _show(value) -> str:
    """A default as it is written after `key=`: YAML's true/false, and "" for the empty string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and (value == "" or value != value.strip()):
        return json.dumps(value)  # quoted as it must be typed: "" or "def "
    return str(value)


def help_text(command: Command) -> str:
    """Usage, description, flags and (for config commands) every config field with its default."""
    lines = [f"usage: {command.prog} {command.usage}", "",
             textwrap.fill(command.description, 100), "", "flags:"]
    lines += columns([(f.spelling, f.help) for f in _flags(command)]
                     + [("-h, --help", "print this help and exit")], indent="  ")
    if command.takes_config:
        lines += ["", "config fields (CONFIG.yaml sets them; key=value overrides any of them, "
                      "e.g. train.steps=20):"]
        lines += columns([(name, typ, _show(default), meaning)
                          for name, typ, default, meaning in config_lib.field_docs()], indent="  ")
    return "\n".join(lines)


def report(text: str, record: dict, as_json: bool) -> int:
    """A command's report; with `--json`, then its record as one JSON object, the last line of
    stdout (for scripts). Returns 0, the command's exit status."""
    if text:
        print(text, flush=True)
    if as_json:
        print(json.dumps(record), flush=True)
    return 0


class Failure(RuntimeError):
    """A run that failed for a reason its one line says (exit status 1, no traceback)."""


class _Stdout(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a record comes (pytest and notebooks swap it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def log_to_stdout() -> None:
    """The `spmd3d` logger's messages on stdout, as plain lines (what the commands print);
    a program that set up its own handler keeps it."""
    logger = logging.getLogger("spmd3d")
    if not logger.handlers:
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def run(command: Command, argv: list[str] | None, body: Callable[[Args], int | None]) -> int:
    """The whole `main` of a command: `--help`/`-h` prints help (exit 0) before anything else;
    otherwise `body(parse(...))` whose int (None: 0) is the exit status. A ConfigError or
    DataError (and a step that cannot fit) becomes one line, `error: <field>: <message>`, on
    stderr and exit status 2; a `Failure` (an out-of-memory error while running), one line and
    status 1."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        try:
            print(help_text(command), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; so does the help
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    log_to_stdout()
    try:
        status = body(parse(command, argv))
    except (ConfigError, DataError) as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except Failure as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 1
    return 0 if status is None else int(status)
