"""`python -m spmd3d.convert import HF_DIR RUN_DIR [key=value ...]` and
`python -m spmd3d.convert export RUN_DIR HF_DIR [--step=N] [--dtype=D] [--max-shard-gb=N]`:
the command over the package's `import_hf` and `export_hf` (what each writes and holds in
memory is said there)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from .. import cli
from ..config import ConfigError
from ..mesh import simulate_devices
from . import EXPORT_DTYPES, export_hf, import_config, import_hf

LOG = logging.getLogger("spmd3d")

COMMAND = cli.Command(
    prog="python -m spmd3d.convert",
    usage=("import HF_DIR RUN_DIR [key=value ...] [--config=PRESET]  |  "
           "export RUN_DIR HF_DIR [--step=N] [--dtype=D] [--max-shard-gb=N]"),
    description=("Import a Hugging Face LLaMA-family directory (config.json + safetensors) into "
                 "a run directory that `python -m spmd3d.train RUN_DIR/config.yaml` fine-tunes "
                 "on any mesh; or export a run's checkpoint as a directory that "
                 "transformers.LlamaForCausalLM.from_pretrained loads. key=value overrides the "
                 "run's config (mesh.*, train.*, optim.*: see python -m spmd3d.train --help); "
                 "the model.* shape fields come from config.json."),
    flags=(cli.Flag("--config", kind="str", help="import: the run's config before the "
                                                "overrides (a preset's name or a YAML path)"),
           cli.Flag("--step", kind="int", minimum=0, help="export: this step (default newest)"),
           cli.Flag("--dtype", kind="str", help="export: float32 (default), bfloat16 or float16"),
           cli.Flag("--max-shard-gb", kind="int", minimum=1,
                    help="export: largest safetensors file, GB (default 5)")),
    takes_config=False,
)


def _run(args: cli.Args) -> int:
    pos = [a for a in args.positional if "=" not in a]
    overrides = [a for a in args.positional if "=" in a]
    if len(pos) != 3 or pos[0] not in ("import", "export"):
        raise ConfigError("argv", f"usage: {COMMAND.prog} {COMMAND.usage}")
    verb, src, dst = pos
    if not Path(src).is_dir():
        raise ConfigError("HF_DIR" if verb == "import" else "RUN_DIR", f"{src} is not a directory")
    if verb == "export":
        if overrides or args.flags.get("--config"):
            raise ConfigError("argv", "export takes no config (the checkpoint has its own)")
        dtype = args.flags.get("--dtype", "float32")
        if dtype not in EXPORT_DTYPES:
            raise ConfigError("--dtype", f"{dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
        simulate_devices(1)
        files = export_hf(src, dst, args.flags.get("--step"), dtype,
                          args.flags.get("--max-shard-gb", 5) << 30)
        LOG.info(f"exported {src} to {dst}: config.json, {', '.join(files)}")
        return 0
    from .. import dist

    cfg = import_config(src, args.flags.get("--config"), overrides)
    simulate_devices(cfg.mesh.simulated_devices)
    dist.initialize(cfg)
    import_hf(src, dst, cfg)
    LOG.info(f"imported {src} into {dst} (step 0); fine-tune with: python -m spmd3d.train "
             f"{dst}/config.yaml [key=value ...]")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
