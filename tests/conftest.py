"""Every test runs on 8 simulated CPU devices: the flag must be set before jax is imported.

XLA:CPU's LLVM backend runs at optimisation level 1: the suite is compile-bound (small
programs, few steps) and LLVM's default optimisation is a large part of each compile (a quarter
of the suite's time). What the tests assert is decided before it -- the HLO passes, buffer
assignment, the collectives -- and every comparison is between programs compiled alike. Not
level 0, which compiled as fast: on an AVX2-only machine (jax 0.12.0.1) its code for the ZB-H1
FP8 step gave a QKV weight gradient 1.75e-2 (L2) off one device's, at levels 1 and 3 within
the test's 3e-3, and on the machines before it within too (`test_fp8.py`); one device and 1F1B
at level 0 agreed to 2e-7, so the code LLVM made at level 0 is what differed.

One persistent compilation cache serves the whole session, its xdist workers and the processes
tests start (a run resumed in a fresh process, the processes of a multi-host job, a notebook's
kernel): a program compiled twice is compiled once. It is fresh each session and removed at its
end, so nothing carries over from one run of the suite to the next; so is the directory where
the workers share the one-device references every layout is compared with."""

import atexit
import os
import shutil
import tempfile

# --xla_cpu_experimental_ynn_fusion_type=-individual_dot: every bf16 dot summed in fp32, as a
# GPU sums it. jaxlib 0.12's XLA:CPU (not 0.10.2's) leaves a bf16 x bf16 -> bf16 dot in bf16
# when YNNPACK's dot accepts it, which it decides before layout assignment; a dot YNNPACK then
# refuses (an operand contracted over its major dim, as the weight gradient of `btf,fd->btd`)
# runs in XLA's own bf16 kernel, which rounds partial sums to bf16. Measured with jax
# 0.12.0.1: one device's bf16 `w_down` gradient (512 tokens) 5.1 units of bf16 roundoff off
# fp32 (9.2 on Python 3.11's corpus), the 8-device layouts (64 tokens a device) 1.2-1.5, so
# test_bf16 compared right layouts with a wrong reference; with the flag 1.2. Runs keep
# XLA's default: it is what the CPU benchmarks beside MaxText compare (docs/benchmarks.md);
# on 8 simulated devices (d_model 256) the flag took a bf16 step from 0.39 to 0.51 s and an
# fp32 step from 0.53 to 0.54-0.61 s. jaxlib 0.10.2 knows the flag too.
for _FLAG in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=1",
              "--xla_cpu_experimental_ynn_fusion_type=-individual_dot"):
    if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the session's first process: the workers
    # and every subprocess inherit it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd3d-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
if "SPMD3D_TEST_SHARED" not in os.environ:  # what the workers share (`helpers.reference_run`)
    os.environ["SPMD3D_TEST_SHARED"] = tempfile.mkdtemp(prefix="spmd3d-tests-")
    atexit.register(shutil.rmtree, os.environ["SPMD3D_TEST_SHARED"], True)


# `make test-fast`: each feature once, within three minutes (`make test` runs everything,
# among it what is left out here for its cost: real multi-process jobs, MLA's layouts, a run
# resumed on other meshes, the planner's drawn layouts). An entry is a test file (all its
# tests), a test, or one parametrization of it.
FAST = (
    # the contract: configuration, the command line, the docs, the import graph
    "test_config.py", "test_cli.py", "test_docs.py", "test_structure.py",
    # every axis against one device, and ZeRO's shardings as placed
    "test_equivalence.py::test_grads_match_one_device[zero3_dp2_tp4_sp_accum_remat]",
    "test_zero.py::test_initialized_state_lives_where_the_rules_say",
    "test_collectives.py::test_tensor_parallel_all_reduces[2-4]",
    "test_pipeline.py::test_every_table_runs_each_operation_once_after_what_it_needs",
    "test_pipeline.py::test_pipeline_losses_match_one_device[zb_dp2_pp2_tp2_sp_zero3]",
    "test_context.py::test_context_parallel_grads_match_one_device[dp2_seq4_tiles2]",
    "test_per_device.py",
    # the features: MoE, bfloat16, FP8, packed documents, the chunked loss
    "test_moe.py::test_routing_is_transformers[mixtral-True]",
    "test_moe.py::test_deepseek_v3_routing_is_transformers[4-2-True-2.5]",
    "test_tgmm.py::test_weight_gradient_equals_the_oracle",
    "test_moe_layouts.py::test_moe_layouts_match_one_device[ep2_dp4_tp2_sp]",
    "test_bf16.py::test_bf16_matches_one_device[dp4_tp2_sp]",
    "test_fp8.py::test_layouts_give_one_devices_fp8_numbers[dp4_tp2_sp]",
    "test_documents.py::test_packed_documents_on_8_devices_equal_one[dp4_ring2]",
    "test_loss.py::test_loss_chunks",
    "test_offload.py::test_offloading_matches_one_device[offload_dp2_tp4_sp_zero3]",
    "test_offload.py::test_a_gpu_program_copies_to_the_host_and_back",
    "test_hsdp.py::test_collectives_run_per_group",
    "test_deepseek.py::test_import_onto_tensor_and_experts_gives_one_device_logits",
    "test_mtp.py::test_import_gives_transformers_mtp_loss",
    # the planner against the compiled step
    "test_estimate.py::test_analytic_memory_is_the_compiled_within_5_percent[tensor 2 SP, seq 2, zero3, save_dots]",
    # a run: checkpoints onto other meshes, data, Hugging Face, generation, the API
    "test_checkpoint.py::test_resharding_roundtrip[False]",
    "test_data.py",
    "test_convert.py::test_import_onto_a_mesh_gives_one_device_logits[data2_tensor4]",
    "test_generate.py::test_greedy_equals_argmax_of_full_logits[tensor4]",
    "test_api.py::test_params_table_matches_rules_and_the_state",
    "test_chat.py::test_tokens_are_transformers_and_only_the_assistant_is_trained",
    "test_mixture.py::test_a_steps_batch_is_the_same_whatever_the_processes",
    "test_plan.py::test_plan_from_a_topology_equals_the_plan_on_devices",
    # several hosts: discovery, the launchers, the watchdog, each process's rows
    "test_dist.py",
)


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        node = item.nodeid.removeprefix("tests/").partition("@")[0]  # less xdist's group
        if any(node == f or node.startswith((f + "::", f + "[")) for f in FAST):
            item.add_marker(pytest.mark.fast)
        if getattr(config.option, "loadgroup", False):
            _keep_group(item)


def _keep_group(item) -> None:
    """Give a grouped test its "@group" suffix where pytest >= 9.2 dropped it.

    `--dist loadgroup` keeps an `xdist_group` on one worker by reading that suffix of the
    node id, which pytest-xdist 3.8 writes into `item._nodeid`; pytest 9.2 keeps node ids in
    `item._id` and never reads `_nodeid`, so every group was scattered without a word
    (pytest-xdist issue 1386). Older pytest (no `_id`) and an xdist that wrote it are left
    alone."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
             for m in item.iter_markers("xdist_group")}
    if not names or not hasattr(item, "_id") or "@" in item.nodeid.rpartition("]")[2]:
        return
    from _pytest.nodeid import NodeId  # pytest has no public way to set an item's id

    item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")
