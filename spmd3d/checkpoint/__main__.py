"""`python -m spmd3d.checkpoint info RUN_DIR [--verify]`: a run's checkpoints, one line each
(step, complete or not, size, when written, mesh, ZeRO stage, key schema), every array read
back and its fingerprint checked with --verify."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .. import cli
from ..config import ConfigError
from ..units import human
from . import info


COMMAND = cli.Command(
    prog='python -m spmd3d.checkpoint',
    usage='info RUN_DIR [--verify]',
    description=('Lists the checkpoints of a run (RUN_DIR or RUN_DIR/checkpoints): step, whether '
                 'complete, size, when written, mesh and ZeRO stage, key schema; --verify reads '
                 'every array back and checks its fingerprint.'),
    flags=(cli.Flag('--verify', help='read every complete step back and check its fingerprints'),),
    takes_config=False,
)


def _info(args: cli.Args) -> int:
    if len(args.positional) != 2 or args.positional[0] != 'info':
        raise ConfigError('argv', f'usage: {COMMAND.prog} {COMMAND.usage}')
    run_dir, verify = args.positional[1], bool(args.flags.get('--verify'))
    if not Path(run_dir).is_dir():
        raise ConfigError('RUN_DIR', f'{run_dir} is not a directory')
    rows = info(run_dir, verify=verify)
    if not rows:
        print(f'no checkpoints in {run_dir}')
        return 0
    head = f"{'step':>8}  {'status':<10}  {'size':>10}  {'written':<19}  mesh (data,stage,tensor,seq)"
    print(head + ('  verify' if verify else ''))
    for r in rows:
        mesh = r['mesh']
        shape = 'x'.join(str(mesh.get(a, '?')) for a in ('data', 'stage', 'tensor', 'seq')) \
            if mesh else '-'
        status = 'complete' if r['complete'] else 'incomplete'
        when = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['written']))
        zero = f", ZeRO-{r['zero']}" if r['zero'] is not None else ''
        schema = f", schema {r['schema']}" if r['schema'] is not None else ''
        size = human(r['bytes'], binary=True)
        line = f"{r['step']:>8}  {status:<10}  {size:>10}  {when}  {shape}{zero}{schema}"
        if r.get('problem'):
            line += f"  ({r['problem']})"
        if 'verified' in r:
            line += f"  {r['verified']}"
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m spmd3d.checkpoint info RUN_DIR [--verify]``."""
    return cli.run(COMMAND, argv, _info)


if __name__ == '__main__':
    sys.exit(main())
