#!/usr/bin/env bash
# One GPU's numbers, most important first: the experts' grouped-matmul kernels alone (each
# candidate's TFLOP/s and error), MoE steps coarse and fine-grained (MFU by active parameters,
# a profile's top ops) against their dense models, the one-GPU presets (LLaMA-3.2-1B and -3B
# shapes) in bf16 and with FP8 projections, the fused attention against the blocked one (and
# both with packed documents, beside the Pallas kernel that takes their ids), and the planner
# calibrated on the 1B run then asked to predict the 3B one; with several GPUs, the pipeline
# schedules (GPipe, 1F1B, ZB-H1, interleaved 1F1B) against each other. About 8 minutes on one
# H200 (each row bounded by BENCH_TIMEOUT seconds, default 150).
#
#   launch/bench_gpu.sh [OUTDIR]       (default runs/bench_gpu; PYTHON=... to pick the interpreter)
#   BENCH_SMALL=1 launch/bench_gpu.sh  (every row at toy widths: checks the script on a CPU)
#   BENCH_ROWS="gpu_3b deepseek" launch/bench_gpu.sh  (only the rows named; `kernels` and `plan`
#                                                      name the kernels' and the planner's steps)
#
# Runs from a checkout without installing it (PYTHONPATH), so a machine that already has jax with
# its CUDA plugin, flax, optax and orbax needs nothing else. Each record is OUTDIR/NAME.json (the
# last line of `bench --json`), each log OUTDIR/NAME.log.
set -u
cd "$(dirname "$0")/.."
out=${1:-runs/bench_gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
# stopped from outside (a scheduler's or a wrapper's timeout): the row running stops too, and
# leaves the GPU's memory to whatever runs next
trap 'pkill -TERM -P $$; exit 143' TERM INT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

"$py" -c "import sys, jax, flax, optax, orbax.checkpoint as o; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv || true

want() { [ -z "${BENCH_ROWS:-}" ] || [[ " $BENCH_ROWS " == *" $1 "* ]]; }
bench() {  # NAME CONFIG [args...]: one bench run, bounded, its record and log under $out
  local name=$1; shift
  want "$name" || return 0
  local t0=$SECONDS config=$1; shift
  timeout "${BENCH_TIMEOUT:-150}" "$py" -m spmd3d.bench "$config" "${small[@]}" "$@" --json > "$out/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  tail -n 1 "$out/$name.log" > "$out/$name.json"
  grep -E "^  (step time|throughput|memory/dev|peak in use|compile|attention|documents|experts|collectives|fp8)" \
    "$out/$name.log" || tail -n 5 "$out/$name.log"
}
# BENCH_SMALL=1: every row at toy widths on whatever devices there are (FP8 emulated), to check
# the script on a CPU before GPU minutes go to it; a row's own overrides come after these
small=()
if [ -n "${BENCH_SMALL:-}" ]; then
  small=(model.d_model=128 model.num_heads=4 model.num_kv_heads=2 model.d_ff=256 model.vocab_size=512
         train.seq_len=128 train.global_batch=2 model.fp8_emulate=true parallel.loss_chunk=64)
fi
t_start=$SECONDS

# The rows in the order they matter, so that a short GPU window measures the first ones.
# 1. FP8 projections (delayed scaling, the GEMMs given FP8 operands) against bf16 at 3B and 1B:
#    tokens/s, MFU against the float8 peak, and the FP8 GEMMs XLA made of the projections
bench gpu_3b configs/gpu_3b.yaml --steps=6
bench gpu_3b_fp8 configs/gpu_3b.yaml --steps=6 model.fp8=delayed
bench gpu_1b configs/gpu_1b.yaml --steps=6
bench gpu_1b_fp8 configs/gpu_1b.yaml --steps=6 model.fp8=delayed
# 2. DeepSeek-V3's kind at DeepSeek-V2-Lite's widths on the 1B's embedding, cut to 4 layers (one
#    dense first): latent attention (heads of 128 + a shared rotary 64, values of 128, a 512-wide
#    key/value latent), 64 experts of 1408 and 2 shared ones, top-6 from the best 4 of 8 groups
#    by sigmoid scores; which attention kernel the plan picks for its head widths, MFU by active
#    parameters
ds=(model.num_layers=4 model.dense_layers=1 model.num_heads=16 model.num_kv_heads=16
    model.kv_lora_rank=512 model.qk_nope_head_dim=128 model.qk_rope_head_dim=64
    model.v_head_dim=128 model.num_experts=64 model.experts_per_token=6 model.d_ff_expert=1408
    model.shared_experts=2 model.router_score=sigmoid model.router_groups=8
    model.router_topk_groups=4 model.router_bias_rate=0.001)
[ -n "${BENCH_SMALL:-}" ] && ds+=(model.num_heads=4 model.num_kv_heads=4 model.kv_lora_rank=32
  model.qk_nope_head_dim=16 model.qk_rope_head_dim=8 model.v_head_dim=16 model.d_ff_expert=32
  model.experts_per_token=2)
bench deepseek configs/gpu_1b.yaml --steps=6 "${ds[@]}"
# 3. The experts' grouped-matmul kernels alone, at the MoE rows' shapes: each kernel of the
#    forward, the input's gradient and the weights' gradient, its TFLOP/s and its error
#    against XLA in fp32 (`python -m spmd3d.microbench`; `--small` on a CPU)
want kernels && echo "== grouped-matmul kernels" &&
timeout "${KERNELS_TIMEOUT:-150}" "$py" -m spmd3d.microbench ${BENCH_SMALL:+--small} \
  --budget=90 --json="$out/kernels.json" 2>&1 | tee "$out/kernels.log" | grep -v "^WARNING"

# 4. Mixture-of-Experts on the 1B shape cut to 8 layers: 8 experts of half the MLP's width,
#    top-2 (the dense MLP's active FLOPs), as the plan picks its kernels (on Hopper jax's
#    Mosaic GPU grouped matmul, and our weight gradient, tgmm.py); `--experts`: the grouped
#    matmul's TFLOP/s against a dense matmul of the same FLOPs. Fine-grained: Qwen3-30B-A3B's
#    experts (128 of 768, top-8) in 4 layers of the 1B's attention.
moe=(model.num_layers=8 model.num_experts=8 model.experts_per_token=2 model.d_ff_expert=4096)
fine=(model.num_layers=4 model.num_experts=128 model.experts_per_token=8 model.d_ff_expert=768)
[ -n "${BENCH_SMALL:-}" ] && moe+=(model.d_ff_expert=128) && fine+=(model.d_ff_expert=32)
bench moe configs/gpu_1b.yaml --steps=6 --experts --profile="$out/trace_moe" "${moe[@]}"
rm -rf "$out/trace_moe"  # the summary is in the record; the trace itself is large
bench moe_fine configs/gpu_1b.yaml --steps=6 "${fine[@]}"
# 5. The baselines: the dense models of the MoE rows' layers, tokamax's forward and input
#    gradient (when importable), the capacity path; the packed-document attention row; FP8's
#    casts without its GEMMs. (XLA's own grouped kernels, 21.6 % MFU at the coarse row with a
#    padded copy that the fine row cannot hold, are in docs/moe.md: `model.expert_kernel=ragged
#    model.expert_weight_grad=xla` runs them.)
bench moe_dense configs/gpu_1b.yaml --steps=6 model.num_layers=8
bench moe_fine_dense configs/gpu_1b.yaml --steps=6 model.num_layers=4
"$py" -c "import tokamax" 2>/dev/null && \
  bench moe_tokamax configs/gpu_1b.yaml --steps=6 "${moe[@]}" model.expert_kernel=tokamax
bench moe_capacity configs/gpu_1b.yaml --steps=6 "${moe[@]}" model.capacity_factor=1.25
bench attention configs/gpu_1b.yaml --steps=2 --attention model.num_layers=2
bench gpu_1b_fp8_emulated configs/gpu_1b.yaml --steps=6 model.fp8=delayed model.fp8_emulate=true
echo "== single-GPU rows done in $((SECONDS - t_start)) s"

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

want plan && for name in gpu_1b gpu_3b; do
  echo "== plan $name, calibrated on gpu_1b"
  "$py" -m spmd3d.plan "configs/$name.yaml" --calibrate="$out/gpu_1b.json" > "$out/plan_$name.txt" 2>&1 \
    || { echo "(no gpu_1b record to calibrate with)"; continue; }
  cat "$out/plan_$name.txt"
done
