"""`python -m spmd3d.generate RUN_DIR|HF_DIR --prompt TEXT [--max-new N] [--temperature T]
[--top-p P] [--seed S] [key=value ...]`: text from a trained run or a Hugging Face model, one
device by default (`mesh.tensor=N` splits it); the decoding is `Generator`'s."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import cli
from ..config import ConfigError
from ..mesh import simulate_devices
from . import TEMPERATURE, TOP_P, Generator, load

COMMAND = cli.Command(
    prog="python -m spmd3d.generate",
    usage=("RUN_DIR|HF_DIR (--prompt TEXT | --prompts FILE) [--max-new N] [--temperature T] "
           "[--top-p P] [--seed S] [key=value ...]"),
    description=("Generate text from a run's newest checkpoint or a Hugging Face LLaMA directory, "
                 "with a KV cache (prefill once, then one token per step). One device by "
                 "default; mesh.tensor=N splits the model over N devices. train.seq_len=N sets "
                 "the cache length (prompt plus new tokens); other key=value fields override the "
                 "run's config as in python -m spmd3d.train."),
    flags=(cli.Flag("--prompt", kind="str", help="the text to continue"),
           cli.Flag("--prompts", kind="str", help="a file of prompts, one per line (a batch)"),
           cli.Flag("--max-new", kind="int", minimum=1, help="new tokens at most (default 200)"),
           cli.Flag("--temperature", kind="str", help="softmax temperature (default 0.7); "
                                                     "0: greedy"),
           cli.Flag("--top-p", kind="str", help="sample from the top-p probability mass "
                                               "(default 0.9; 1: all)"),
           cli.Flag("--seed", kind="int", minimum=0, help="the sampling seed (default 0)")),
    takes_config=False,
)


def _number(args: cli.Args, name: str, default: float, lo: float, hi: float) -> float:
    raw = args.flags.get(name)
    try:
        value = default if raw is None else float(raw)
    except ValueError:
        raise ConfigError(name, f"expected a number, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ConfigError(name, f"must be in [{lo}, {hi}], got {value}")
    return value


def _prompts(args: cli.Args) -> list[str]:
    if ("--prompt" in args.flags) == ("--prompts" in args.flags):
        raise ConfigError("--prompt", "give one of --prompt TEXT or --prompts FILE")
    if "--prompt" in args.flags:
        return [args.flags["--prompt"]]
    path = Path(args.flags["--prompts"])
    if not path.is_file():
        raise ConfigError("--prompts", f"{path} is not a file")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("--prompts", f"{path} holds no prompt")
    return prompts


def _run(args: cli.Args) -> int:
    pos = [a for a in args.positional if "=" not in a]
    overrides = [a for a in args.positional if "=" in a]
    if len(pos) != 1:
        raise ConfigError("argv", f"usage: {COMMAND.prog} {COMMAND.usage}")
    source = Path(pos[0])
    if not source.is_dir():
        raise ConfigError("RUN_DIR", f"{source} is not a directory")
    prompts = _prompts(args)
    temperature = _number(args, "--temperature", TEMPERATURE, 0.0, 100.0)
    top_p = _number(args, "--top-p", TOP_P, 1e-6, 1.0)
    simulate_devices(next((int(o.split("=", 1)[1]) for o in overrides
                           if o.startswith("mesh.simulated_devices=")), -1))
    plan, graphdef, params, tok = load(source, overrides)
    gen = Generator(plan, graphdef, params, temperature, top_p)
    ids = [tok.encode(p) for p in prompts]
    shown = [0]

    def stream(out):  # one prompt: its text as it comes
        text = tok.decode(out[0])
        print(text[shown[0]:], end="", flush=True)
        shown[0] = len(text)

    if len(prompts) == 1:
        print(prompts[0], end="", flush=True)
    out = gen.generate(ids, args.flags.get("--max-new", 200), args.flags.get("--seed", 0),
                       tok.stop_ids, stream if len(prompts) == 1 else None)
    if len(prompts) == 1:
        print()
    else:
        for p, new in zip(prompts, out):
            print(f"--- {p!r}\n{p}{tok.decode(new)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
