"""A user's install: the built wheel (not an editable checkout) in a fresh virtual environment
trains from any directory, with the presets and topologies it ships."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(args, cwd, env=None):
    out = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    return out


def test_the_built_wheel_trains_from_another_directory(tmp_path):
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "-w", tmp_path / "dist", ROOT], cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("spmd3d-*.whl")
    env_dir = tmp_path / "env"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp_path)
    python = env_dir / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet",
         wheel], cwd=tmp_path)
    # the dependencies (jax, flax, ...) from this interpreter's site-packages, as a plain path:
    # its .pth files, among them this checkout's editable hook, are not run
    site = Path(sysconfig.get_paths(vars={"base": str(env_dir)})["purelib"])
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS", "VIRTUAL_ENV")}
    where = run([python, "-c", "import spmd3d; print(spmd3d.__file__)"], cwd=work, env=env)
    assert where.stdout.strip().startswith(str(env_dir)), where.stdout
    out = run([python, "-m", "spmd3d.train", "demo", "train.steps=2", "model.num_layers=1",
               "train.seq_len=32", "train.global_batch=8", "run.dir=run"], cwd=work, env=env)
    assert "step 2/2" in out.stdout and (work / "run" / "metrics.jsonl").exists(), out.stdout
    presets = run([python, "-c", "import spmd3d; print(spmd3d.configure('gpt3_175b').mesh)"],
                  cwd=work, env=env)
    assert "stage=16" in presets.stdout
