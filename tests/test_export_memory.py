"""Hugging Face export and import at real size: the host holds about one layer of one weight.

A 24-layer model whose largest stacked weight (the MLP's gate and up projections, 8 MiB a
layer in fp32) is 24 times one layer. Its checkpoint holds the parameters alone (what an export
reads), in random values. In a process of its own, with its peak resident memory reset once
everything is imported:
* export reads each stacked weight a layer at a time, each layer a chunk (an eighth of it) at a
  time, and streams the safetensors files: its peak is below 3 layers above the baseline, and its files equal, tensor for tensor and bit for
  bit, what a whole-array export (the previous one) wrote;
* import reads each tensor on its own (no memory map) and places a weight a layer at a time,
  each layer in slabs: weight by weight, above the parameters it places on the device (host
  memory here), its peak is likewise bounded (the step-0 save that follows is orbax's, which
  stages what it saves as any save);
* a damaged array stops the export with one line, exit 2, and no output directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from spmd3d import config

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.num_layers=24", "model.dtype=float32", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=4",
         "model.d_ff=4096", "model.vocab_size=256", "mesh.simulated_devices=0", "mesh.data=1",
         "mesh.tensor=1"]
LAYER = 256 * 2 * 4096 * 4  # bytes of one layer of blocks/mlp/w_gate_up

MEASURE = """
import json, sys
import numpy, tensorstore, tqdm, safetensors.numpy
from spmd3d import checkpoint, convert, hf, hf_files
from spmd3d.checkpoint import slices
import jax; jax.devices()

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

what, src, dst = sys.argv[1:4]
# the baseline: the libraries loaded and set up (a checkpoint's metadata read, a HF directory's
# headers, the layout planned), which costs the same whatever the model's size
if what == "import":
    from spmd3d import store
    from spmd3d.plan import Plan
    from spmd3d.step import canonical_state

    cfg = convert.import_config(src, None, ["mesh.simulated_devices=0", "mesh.tensor=1",
                                           "mesh.data=1", "mesh.seq=1", "mesh.stage=1"])
    plan = Plan.resolve(cfg, jax.devices()[:1])
    target = store.flat(store.abstract_like(*canonical_state(plan)).params)
    reader = hf.Reader(src)
    # each weight placed once first: the small programs import compiles (once per stacked
    # weight's shape) cost the same whatever the model's size
    for w in hf.weights(cfg.model):
        convert._place(reader, w, cfg.model, target[w.key]).delete()
    # then each weight alone, its peak less the parameters it placed: the stacked weights'
    # (the step-0 save after it is orbax's, as any save)
    above, made = {}, 0
    for w in hf.weights(cfg.model):
        open("/proc/self/clear_refs", "w").write("5")
        base = kib("VmRSS:")
        placed = convert._place(reader, w, cfg.model, target[w.key])
        above[w.key] = kib("VmHWM:") - base - placed.nbytes
        made += placed.nbytes
        placed.delete()
    print(json.dumps({"above": above, "made": made}))
    sys.exit()
list(slices.StepArrays(src).layers("params/final_norm/scale", stacked=False))
open("/proc/self/clear_refs", "w").write("5")  # the peak, from here on
base = kib("VmRSS:")
convert.export_hf(src, dst)
print(json.dumps({"base": base, "peak": kib("VmHWM:")}))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A step-4 checkpoint of random parameters (no optimizer state), saved as training does."""
    from spmd3d import store
    from spmd3d.checkpoint import Checkpointer
    from spmd3d.model import abstract_model

    cfg = config.load(None, MODEL)
    _, params = abstract_model(cfg.model, tuple(range(cfg.model.num_layers)))
    shapes = {f"params/{k}": v for k, v in store.flat(params).items()}
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    state = {k: jax.device_put(rng.standard_normal(v.shape, np.float32), device)
             for k, v in shapes.items()}
    assert state["params/blocks/mlp/w_gate_up"].nbytes == 24 * LAYER
    run = tmp_path_factory.mktemp("export") / "run"
    with Checkpointer(run / "checkpoints", every=0, keep=1, async_save=False) as ckpt:
        ckpt.save(4, state, {"step": 4, "config": config.to_dict(cfg)}, force=True)
    return run


def _measure(what: str, src: Path, dst: Path) -> dict:
    """Run MEASURE. glibc's malloc maps a block above its mmap threshold and unmaps it when
    freed; the threshold grows with the blocks freed, up to 32 MiB. Real layers (0.9 GB for
    LLaMA-3 8B's MLP) are above that, so what was freed leaves the process; this model's 8 MiB
    layers are not, and freed layers would stay resident in malloc's heap. A fixed 1 MiB
    threshold makes the small model behave as the real one does."""
    import os

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run([sys.executable, "-c", MEASURE, what, str(src), str(dst)],
                         capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_export_holds_a_layer_and_writes_what_a_whole_array_export_did(run_dir, tmp_path):
    from spmd3d import checkpoint
    from spmd3d.checkpoint.slices import StepArrays
    from spmd3d.hf import weights
    from spmd3d.hf_files import Files

    chunk = StepArrays(run_dir)._open("params/blocks/mlp/w_gate_up").chunk_layout.read_chunk
    assert np.prod(chunk.shape) * 4 == LAYER // 8, chunk  # what a read holds: an eighth layer
    got = _measure("export", run_dir, tmp_path / "hf")
    above = got["peak"] - got["base"]
    print(f"export: peak {above / 2**20:.1f} MiB above the baseline; one layer "
          f"{LAYER / 2**20:.0f} MiB, the weight {24 * LAYER / 2**20:.0f} MiB")
    assert above < 3 * LAYER, above

    cfg = config.load(None, MODEL)
    files = Files(tmp_path / "hf")
    for w in weights(cfg.model):  # the previous export: whole arrays, then each layer
        key = f"params/{w.key}"
        value = np.asarray(checkpoint.read(run_dir, [key])[0][key])
        for layer in (range(value.shape[0]) if w.stacked else [None]):
            part = value if layer is None else value[layer]
            for name, t in zip(w.hf_names(layer), w.to_hf(part, cfg.model)):
                assert np.array_equal(files[name].view(np.uint32), t.view(np.uint32)), name


def test_import_places_a_layer_at_a_time(run_dir, tmp_path):
    from spmd3d import convert

    convert.export_hf(run_dir, tmp_path / "hf")
    got = _measure("import", tmp_path / "hf", tmp_path / "run")
    key, worst = max(got["above"].items(), key=lambda kv: kv[1])
    print(f"import: peak {worst / 2**20:.1f} MiB above the baseline and the parameters it "
          f"placed, at {key}; one layer {LAYER / 2**20:.0f} MiB")
    assert got["made"] > 24 * LAYER and worst < 3 * LAYER, got
    assert got["above"]["blocks/mlp/w_gate_up"] > LAYER, got  # a layer converted, at least


def test_a_damaged_array_stops_the_export_with_nothing_written(run_dir, tmp_path):
    import shutil

    damaged = tmp_path / "run"
    shutil.copytree(run_dir, damaged)
    blobs = sorted((damaged / "checkpoints" / "4" / "state").rglob("d/*"),
                   key=lambda f: -f.stat().st_size)
    data = bytearray(blobs[0].read_bytes())
    data[len(data) // 3] ^= 0x08
    blobs[0].write_bytes(bytes(data))
    out = subprocess.run([sys.executable, "-m", "spmd3d.convert", "export", str(damaged),
                          str(tmp_path / "hf")], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == 2, out.stderr[-2000:]
    line, = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: checkpoint: ") and "step 4 is damaged" in line, line
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if "export-tmp" in p.name]
