"""notebooks/small_meshes.ipynb runs top to bottom in a real Jupyter kernel without an error.

The kernel is this interpreter (a kernelspec written to a temp dir pins `sys.executable`, so a
user-level `python3` kernelspec cannot swap in another Python), it starts in a temp directory
(the notebook's run dir is relative, so nothing is written into the repository), and it gets
no simulated-device flags: the notebook's own `spmd3d.simulate(8)` must provide them.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import env_without_devices

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "small_meshes.ipynb"
KERNEL = "spmd3d-test"


def kernel_env(jupyter_dir: Path) -> dict:
    env = env_without_devices(platform=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JUPYTER_PATH"] = str(jupyter_dir)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    return env


def write_kernelspec(jupyter_dir: Path) -> None:
    spec = jupyter_dir / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "spmd3d test kernel", "language": "python"}))


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    # simulate() comes before jax is imported, in the first code cell
    first = code[0].source
    assert first.index("spmd3d.simulate(8)") < first.index("import jax")


def test_notebook_runs(tmp_path, monkeypatch):
    jupyter_dir = tmp_path / "jupyter"
    write_kernelspec(jupyter_dir)
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_dir))  # where the client looks up KERNEL
    work = tmp_path / "work"
    work.mkdir()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel must be this interpreter's environment (the one with spmd3d's dependencies)
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        f"import sys\nassert sys.prefix == {sys.prefix!r}, sys.prefix"))
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=600,
                                     resources={"metadata": {"path": str(work)}})
    client.execute(env=kernel_env(jupyter_dir))  # raises CellExecutionError on any error

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure displayed"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "max relative difference to 1 device" in text
    # everything it wrote is under the temp working directory
    assert (work / "runs" / "small_meshes" / "loss_curves.png").stat().st_size > 0
    assert (work / "runs" / "small_meshes" / "zero3" / "checkpoints").is_dir()
