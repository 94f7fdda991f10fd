"""Every test runs on 8 simulated CPU devices: the flag must be set before jax is imported.

XLA:CPU's LLVM backend runs at optimisation level 0: the suite is compile-bound (small
programs, few steps) and LLVM's code generation is most of each compile (2.3 s of a small
8-device step's 2.8-3.1 s in XLA at level 1). What the tests assert is decided before it -- the
HLO passes, buffer assignment, the collectives -- and every comparison is between programs
compiled alike. Level 0 compiles a small 8-device step in 2.1-3.0 s against 3.2-4.3 s at level
1 (`test_zero.py` and `test_equivalence.py` in 90 s against 101; jax 0.12.0.1, 2026-11-30).
It moves float32's last bits, and with them which states of `test_fp8.py`'s warm-up sit on a
step of FP8's rounding; that test compares at the first state off one, at any level.

One persistent compilation cache serves the whole session, its xdist workers and the processes
tests start (a run resumed in a fresh process, the processes of a multi-host job, a notebook's
kernel): a program compiled twice is compiled once. It is fresh each session and removed at its
end, so nothing carries over from one run of the suite to the next; so is the directory where
the workers share the one-device references every layout is compared with. (CI's `make test` and
`make test-slow`, one suite in two sessions, share both: `.ci/run` sets them.)"""

import atexit
import os
import shutil
import tempfile

import pytest

_BROKEN = pytest.StashKey[str]()  # why a test must fail before it runs

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
for _FLAG in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
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


# `make test-fast`: each feature once, within three minutes (`make test` runs more, among it
# what is left out here for its cost: MLA's layouts, the API with an expert axis, the planner's
# drawn layout). An entry is a test file (all its tests), a test, or one parametrization of it.
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


# `make test` leaves these to `make test-slow` (CI runs both, so every test runs before a change
# lands): the real processes (jobs of several hosts, kills, a notebook's kernel, a fresh
# interpreter), compiles at real widths beyond one of each, and the repeats of a layout matrix
# beyond the layouts that each carry a composition of their own. What covers the feature in
# `make test` is named beside each. An entry is as in FAST, or "file.py[id]": every test of
# that file with that parametrization (a layout's loss and gradient tests share one compile).
SLOW = (
    # processes: test_dist's launchers and watchdog, test_resilience's kill -9 and damage,
    # test_checkpoint's resharding, test_convert's import, test_api's Experiment
    "test_multihost.py",
    "test_elastic.py::test_a_lost_host_is_survived_with_the_losses_of_the_whole_job",
    "test_elastic.py::test_too_few_hosts_left_stop_the_job_with_its_reason_and_the_checkpoints_intact",
    "test_notebook.py::test_notebook_runs", "test_api.py::test_readme_api_snippet_runs",
    "test_install.py::test_the_built_wheel_trains_from_another_directory",
    "test_finetune.py::test_import_train_generate_export",
    "test_resilience.py::test_resume_onto_other_meshes_zero_stages_and_pipelines",
    "test_fp8.py::test_scale_state_survives_kill9_and_resumes_exactly",
    "test_hsdp.py::test_a_checkpoint_restores_onto_another_grouping",
    "test_moe_layouts.py::test_checkpoint_resumes_at_another_expert_parallel_degree",
    "test_train.py::test_circular_pipeline_checkpoint_is_canonical",
    "test_api.py::test_data_parallel_losses_equal_one_device",
    # a run resumed: kept is test_train's resume onto another mesh and ZeRO stage (the CLI),
    # which restores what the API's `restore` and a changed optimizer chain restore; the check
    # of a layout's need, kept from the command line (test_memory's refusal in one line)
    "test_api.py::test_save_and_restore_onto_other_meshes",
    "test_train.py::test_clip_norm_toggles_across_a_resume",
    "test_memory.py::test_the_check_in_the_api_and_its_switch",
    # real widths: test_estimate's layouts, the planner's drawn sample; --search's refusals stay.
    # The planner's fixed sample keeps draws 15, 21 and 23 (MoE accumulating, the tables' sum
    # over seq, ZB-H1's branches and a dense MLP's fp32 operands): draw 21 carries the tables'
    # accumulated gradients that test_estimate's accumulating test counts
    *(f"test_planner_property.py[{k}]" for k in ("3", "17")),
    "test_estimate.py::test_accumulating_counts_a_microbatchs_table_gradients_and_their_sum",
    "test_scale.py::test_real_widths_compile_to_the_counted_bytes",
    "test_estimate.py::test_deepseek_v3_preset_compiles_within_an_h800",
    "test_estimate.py::test_moe_presets_compile_within_a_gpu_and_their_plan",
    "test_search.py::test_search_ranks_the_fastest_fitting_zero_stage_of_every_layout",
    "test_search.py::test_the_published_layouts_fit_and_are_ranked",
    "test_search.py::test_search_cli_json_and_compile_top",
    "test_search.py::test_search_lays_out_the_configs_own_device_count",
    "test_search.py::test_search_lays_out_the_experts_too",
    # the planner's layouts: kept are tensor+SP with the ring and ZeRO-3, the ring over 4, 4
    # stages of 1F1B, MoE with tensor+SP, a long sequence under tensor (and make test's drawn
    # layouts); an MoE layer's expert-gradient sum is in make test-planner's draws 6 and 10 too
    "test_estimate.py::test_an_moe_layers_expert_gradient_summed_over_the_tokens_is_counted",
    *(f"test_estimate.py[{k}]" for k in (
        "zero0, remat none", "hsdp 2 x 2, seq 2, zero2, 2 accumulated",
        "moe, 16 experts, 1f1b, no remat", "moe, mtp, experts 2 x 2, tensor 2, zero3",
        "gpipe, mtp, tensor 2", "hsdp 2 x 2, gpipe 2, zero3", "moe, capacity, experts 4 x 2",
        "moe, experts 4 x 2, 2 accumulated", "gpipe, tensor 2 SP, remat stage",
        "tensor 4 SP, zero1", "interleaved 1f1b, tensor 2",
        "ulysses, tensor 2 SP, seq 2, zero3, save_dots", "hsdp 2 x 4, zero3", "circular gpipe",
        "zero1, remat full", "4 accumulated, zero2", "tensor 2, zero2, save_dots",
        "moe, mtp, 1f1b, experts 2, tensor 2", "moe, experts 4, zero3", "ulysses over seq 4",
        "tensor 2 SP, offload_dots", "moe, 1f1b, tensor 2 SP")),
    # pipelines: kept are GPipe with tensor, circular GPipe, 4 stages with the chunked loss, 1F1B
    # and ZB-H1 with tensor+SP+ZeRO-3, interleaved 1F1B, uneven stages; 1F1B's bubble on 4
    # stages, a stage's temporaries; the rest of the schedules' matrix is left, and so are the
    # 8-layer interleaved layouts and 1F1B's and ZB-H1's temporaries against microbatches
    *(f"test_pipeline.py[{k}]" for k in (
        "1f1b_pp2_tp2_seq2_sp", "1f1b_dp4_pp2_m2", "zb_pp2_tp2_seq2_sp",
        "1f1b_dp2_pp2_tp2_v2_m8_sp_zero3", "1f1b_dp2_pp2_tp2_save_dots_zero2", "1f1b_pp4_tp2_m16",
        "zb_dp2_pp2_tp2_v2_m8_sp_zero3", "1f1b_dp2_pp4_m2", "zb_dp4_pp2_m2",
        "zb_dp2_pp2_tp2_stage_remat_zero2", "zb_dp2_pp4_m2", "zb_pp4_tp2_m16", "dp2_pp2_tp2_zero3",
        "zb_dp4_pp2_v2_m2", "1f1b_pp2_tp2_seq2_v2_full_remat",
        "1f1b_dp2_pp4_m8_full_remat_chunked_loss", "zb_dp2_pp2_tp2_save_dots", "dp4_pp2",
        "dp2_pp2_tp2_zero3_tick", "dp2_pp2_tp2_zero3_tick_tables", "1f1b_dp2_pp2_tp2_stage_remat",
        "dp2_pp4_m4", "zb_dp2_pp4_m8_full_remat_chunked_loss", "zb_dp2_pp2_seq2_full_remat",
        "pp4_tp2_m2", "dp2_pp2_tp2_sp_stage_remat", "dp2_pp2_tp2_v2_sp_zero1_remat",
        "2-2-2-gpipe", "2-4-2-1f1b", "2-8-1-1f1b", "4-4-1-gpipe", "2-4-1-gpipe", "2-2-1-gpipe",
        "none-2")),
    "test_pipeline.py::test_interleaved_on_four_stages_matches_one_device",
    # a stage's share of the layers' state in the compiled arguments (two compiles): kept is
    # test_estimate's "1f1b, 4 stages, remat full", whose compiled arguments the planner's
    # stage-split parameter and moment shards must equal
    "test_pipeline.py::test_parameter_bytes_drop_by_stage_count",
    "test_pipeline.py::test_1f1b_and_zb_h1_temporaries_do_not_grow_with_microbatches",
    "test_uneven.py[dp2_pp2_tp2_v2_m2]",
    # MoE: kept are experts with tensor+SP, with ZeRO-3, 1F1B, the capacity path; DeepSeek's
    # MLA and router with experts, tensor and Ulysses; dense layers between MoE ones with ZeRO-3;
    # MTP on and off (and its loss against transformers')
    *(f"test_moe_layouts.py[{k}]" for k in (
        "ep2_tp2_interleaved_1f1b", "ep2_circular_gpipe", "ep8", "ep2_gpipe", "ep4_ring2",
        "ep2_tp2_sp_zb_h1", "ep2_hsdp2_zero3", "dense_every2_ep2_seq2_1f1b_uneven",
        "every2_ep2_tp2_sp_zb_h1")),
    "test_moe_layouts.py::test_deepseek_routing_matches_one_device",
    "test_moe_layouts.py::test_capacity_with_room_for_all_is_dropless_and_reports_what_it_drops",
    "test_mtp.py::test_mtp_matches_one_device",
    "test_deepseek.py::test_dense_layers_before_moe_ones_match_one_device",
    "test_deepseek.py::test_dense_layers_before_a_pipeline_mask_packed_documents",
    *(f"test_deepseek.py[{k}]" for k in (
        "ds_ep2_ring2_tp2", "ds_ep4_tp2_sp_zero3", "ds_ep2_zb_h1_tp2_sp", "ds_ep2_1f1b_tp2")),
    # data x tensor: kept with ZeRO-1 and ZeRO-2 (zero1_dp4_tp2, zero2_dp4_tp2) and with SP
    *(f"test_equivalence.py[{k}]" for k in ("dp2_tp4", "dp4_tp2")),
    # bfloat16: kept are data x tensor+SP, MoE with experts and tensor+SP (the layout whose
    # compile aborted); in pipelines (GPipe, 1F1B, ZB-H1, MoE's 1F1B) and with ZeRO-3 here
    *(f"test_bf16.py[{k}]" for k in (
        "dp2_pp2_tp2_1f1b_zero3", "dp8_zero3", "dp2_pp2_seq2_zb_h1", "dp8_zero1", "dp2_seq4_tiles2", "dp4_seq2",
        "dp4_pp2_gpipe",
        "ulysses_dp2_tp2_seq2_sp", "hsdp2x2_tp2_zero3_offload", "moe_ep2_pp2_1f1b", "moe_ep8",
        "moe_ep4_capacity", "moe_ep4_x2_zero3")),
    "test_bf16.py::test_bf16_deepseek_matches_one_device",
    "test_bf16.py::test_bf16_dense_layers_between_moe_ones_match_one_device",
    # FP8: kept is data x tensor+SP (the amaxes combined over data and tensor; over a pipeline's
    # microbatches here); context: the ring over 4 in tiles, with tensor+SP+ZeRO-3,
    # Ulysses (and against dense attention the ring over 4 and 8, its tiles over 4 and 2);
    # packed documents over the ring and Ulysses, and in the Pallas kernel; offloading with
    # tensor+SP+ZeRO-3; HSDP with ZeRO-3 and accumulation; sampling (one device), greedy
    # decoding over tensor 4, and the latent cache on one layout each
    *(f"test_fp8.py[{k}]" for k in ("dp2_pp2_tp2_1f1b", "zb_dp4_pp2_m4", "zero3_dp2_seq2_tp2_sp")),
    "test_fp8.py::test_amaxes_combine_by_max_over_a_pipelines_microbatches",
    *(f"test_context.py[{k}]" for k in (
        "ulysses_dp2_pp2_seq2_1f1b", "pp2_tp2_seq2_chunked_loss", "dp2_pp2_seq2_zero1",
        "dp2_tp2_seq2_chunked_loss", "ulysses_tp2_seq4_sp_zero3", "seq8", "dp4_seq2")),
    "test_ring.py::test_tiled_ring_steps_equal_dense[2-8-False-False]",
    "test_ring.py::test_ring_equals_dense[2]",
    # the ring's temporaries against seq 1, 2, 4, 8 (four compiles at 4096 tokens): kept is
    # test_estimate's "ring over seq 4", whose compiled bytes at real width the planner holds
    "test_context.py::test_activation_memory_falls_with_the_ring",
    *(f"test_documents.py::test_packed_documents_on_8_devices_equal_one[{k}]" for k in (
        "pp2_1f1b_ring2_dp2", "pp2_zb_h1_gather2_dp2", "dp2_tp2_ring2_micro2", "dp2_ring4",
        "dp2_tp4_sp", "pp2_gpipe_dp2_tp2")),
    "test_documents.py::test_the_pallas_kernel_with_packed_documents_on_8_devices_equals_one"
    "[dp4_tp2_micro2]",
    *(f"test_offload.py[{k}]" for k in (
        "offload_dots_dp4_seq2", "offload_dots_pp2_dp4", "offload_dp2_pp2_tp2_gpipe")),
    *(f"test_hsdp.py[{k}]" for k in ("hsdp_2x2_tp2_zero2", "hsdp_2x4_zero1", "hsdp_2x2_pp2_zero3")),
    "test_generate.py::test_sampling_is_a_function_of_the_seed[tensor4]",
    "test_generate.py::test_greedy_equals_argmax_of_full_logits[one_device]",
    "test_deepseek.py::test_generation_caches_the_latent_and_equals_transformers_greedy[tensor4]",
)
TIERS = {"fast": FAST, "slow": SLOW}


def pytest_collection_modifyitems(config, items):
    """Mark the tiers; keep xdist's groups; fail the tests a wrong tier entry or a lost group
    would let pass unseen (at setup: an error raised here, inside an xdist worker, reaches the
    user as an internal error without its message)."""
    matched = set()
    for item in items:
        node = item.nodeid.removeprefix("tests/").partition("@")[0]  # less xdist's group
        tiers = []
        for tier, entries in TIERS.items():
            hits = [f for f in entries if _selects(f, node)]
            if hits:
                item.add_marker(getattr(pytest.mark, tier))
                matched.update((tier, f) for f in hits)
                tiers.append(tier)
        if len(tiers) > 1:
            item.stash[_BROKEN] = "tests/conftest.py: in both FAST and SLOW"
        if getattr(config.option, "loadgroup", False) and not _keep_group(item):
            item.stash[_BROKEN] = ("--dist loadgroup would not keep its xdist_group on one "
                                   "worker: no '@group' suffix in its node id (_keep_group)")
    # a misspelled entry would move its tests without a word; checked where the entry's file
    # was collected whole (no test chosen by node id or -k)
    if config.option.keyword or any("::" in a for a in config.args):
        return
    for tier, entries in TIERS.items():
        for f in entries:
            if (tier, f) in matched:
                continue
            for item in items:
                if item.nodeid.removeprefix("tests/").partition("::")[0] == _file(f):
                    item.stash[_BROKEN] = f"tests/conftest.py {tier.upper()}: no test matches {f}"


def _selects(entry: str, node: str) -> bool:
    """Whether a tier's entry selects a test's node id (less "tests/" and xdist's group)."""
    by_id = node.partition("::")[0] + "[" + node.partition("[")[2] if "[" in node else None
    return entry in (node, by_id) or node.startswith((entry + "::", entry + "["))


def _file(entry: str) -> str:
    return entry.partition("::")[0].partition("[")[0]


def pytest_runtest_setup(item):
    if _BROKEN in item.stash:
        pytest.fail(item.stash[_BROKEN], pytrace=False)


def _keep_group(item) -> bool:
    """Give a grouped test its "@group" suffix where pytest >= 9.2 dropped it; whether the
    item's node id now carries what `--dist loadgroup` groups by.

    `--dist loadgroup` keeps an `xdist_group` on one worker by reading that suffix of the
    node id, which pytest-xdist 3.8 writes into `item._nodeid`; pytest 9.2 keeps node ids in
    `item._id` and never reads `_nodeid`, so every group was scattered without a word
    (pytest-xdist issue 1386). Older pytest (no `_id`) and an xdist that wrote it are left
    alone."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
             for m in item.iter_markers("xdist_group")}

    def grouped() -> bool:  # the suffix, after the parametrization (an id may hold "@")
        return "@" in item.nodeid.rpartition("]")[2].rpartition("::")[2]

    if not names or grouped():
        return True
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId  # pytest has no public way to set an item's id

        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")
    return grouped()
