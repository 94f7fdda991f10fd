#!/usr/bin/env bash
# One GPU's numbers: throughput, MFU and per-device memory of the one-GPU presets (LLaMA-3.2-1B
# and -3B shapes) in bf16 and with FP8 projections, the fused attention against the blocked
# one (and both with packed documents, beside the Pallas kernel that takes their ids), an MoE
# step (MFU by active parameters) and its grouped matmul against a dense one, a profile's top
# ops, and the planner calibrated on the 1B run then asked to predict the 3B one; with several
# GPUs, the pipeline schedules (GPipe, 1F1B, ZB-H1, interleaved 1F1B) against each other.
#
#   launch/bench_gpu.sh [OUTDIR]       (default runs/bench_gpu; PYTHON=... to pick the interpreter)
#
# Runs from a checkout without installing it (PYTHONPATH), so a machine that already has jax with
# its CUDA plugin, flax, optax and orbax needs nothing else. Each record is OUTDIR/NAME.json (the
# last line of `bench --json`), each log OUTDIR/NAME.log.
set -u
cd "$(dirname "$0")/.."
out=${1:-runs/bench_gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

"$py" -c "import sys, jax, flax, optax, orbax.checkpoint as o; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv || true

bench() {  # NAME CONFIG [args...]: one bench run, bounded, its record and log under $out
  local name=$1; shift
  local t0=$SECONDS
  timeout "${BENCH_TIMEOUT:-300}" "$py" -m spmd3d.bench "$@" --json > "$out/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  tail -n 1 "$out/$name.log" > "$out/$name.json"
  grep -E "^  (step time|throughput|memory/dev|peak in use|compile|attention|documents|experts|collectives|fp8)" \
    "$out/$name.log" || tail -n 5 "$out/$name.log"
}

bench gpu_1b configs/gpu_1b.yaml --steps=10 --attention --profile="$out/trace_1b"
bench gpu_3b configs/gpu_3b.yaml --steps=10
# FP8 projections (delayed scaling) beside the bf16 rows above: tokens/s, MFU against the
# float8 peak, and the FP8 GEMMs XLA made of the projections
bench gpu_1b_fp8 configs/gpu_1b.yaml --steps=10 model.fp8=delayed
bench gpu_3b_fp8 configs/gpu_3b.yaml --steps=10 model.fp8=delayed
# emulated: the same casts and scales, the GEMMs kept in bf16 (0 FP8 GEMMs)
bench gpu_1b_fp8_emulated configs/gpu_1b.yaml --steps=10 model.fp8=delayed model.fp8_emulate=true

# Mixture-of-Experts on the 1B shape cut to 8 layers: 8 experts of half the MLP's width, top-2
# (the dense MLP's active FLOPs), beside the dense model of those 8 layers; the experts' kernel
# as the plan picks it (tokamax when importable: put it and its dependencies on PYTHONPATH, as
# the machine may have no package index), then forced to jax's ragged_dot and to capacity
# buffers. `--experts`: the grouped matmul's TFLOP/s against a dense matmul of the same FLOPs.
moe=(model.num_layers=8 model.num_experts=8 model.experts_per_token=2 model.d_ff_expert=4096)
bench moe_dense configs/gpu_1b.yaml --steps=10 model.num_layers=8
bench moe configs/gpu_1b.yaml --steps=10 --experts "${moe[@]}"
bench moe_ragged configs/gpu_1b.yaml --steps=10 --experts "${moe[@]}" model.expert_kernel=ragged
bench moe_capacity configs/gpu_1b.yaml --steps=10 --experts "${moe[@]}" model.capacity_factor=1.25
rm -rf "$out/trace_1b"  # the summary is in the record; the trace itself is large

# With two or more GPUs: the pipeline schedules against each other on the 1B preset, one stage
# per GPU (up to 8), m = 4p microbatches of one sequence each
gpus=$("$py" -c "import jax; print(min(jax.device_count(), 8))")
if [ "$gpus" -ge 2 ] && [ $((16 % gpus)) -eq 0 ]; then
  sched=(mesh.stage="$gpus" train.global_batch=$((4 * gpus)) train.microbatches=$((4 * gpus)))
  for s in gpipe 1f1b zb_h1; do
    bench "pp${gpus}_$s" configs/gpu_1b.yaml --steps=10 "${sched[@]}" parallel.pipeline_schedule=$s
  done
  bench "pp${gpus}_1f1b_v2" configs/gpu_1b.yaml --steps=10 "${sched[@]}" \
    parallel.pipeline_schedule=1f1b parallel.pipeline_repeats=2
fi

for name in gpu_1b gpu_3b; do
  echo "== plan $name, calibrated on gpu_1b"
  "$py" -m spmd3d.plan "configs/$name.yaml" --calibrate="$out/gpu_1b.json" > "$out/plan_$name.txt" 2>&1
  cat "$out/plan_$name.txt"
done
