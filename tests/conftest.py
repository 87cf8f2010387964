"""Shared test setup: 8 fake CPU devices for sharding tests, fast CPU compiles, the `gpu` and `slow` markers.

Tests marked `@pytest.mark.gpu` need a CUDA device and the cuTile compiler; without them they are
skipped with the reason, never counted as passing.
"""
import os
import subprocess
import sys

# Must happen before jax initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# Most CPU tests' time is XLA compiling small programs, not running them: without LLVM's optimizations, and
# with the CPU backend's older fusion emitters (its MLIR ones cost more compile time on these programs), the
# suite takes about half the CPU time, and float results stay equal to within rounding (every check holds a
# tolerance against a float64 reference, or compares two programs compiled alike).
# Subprocesses (examples, benchmark CLIs) inherit the setting. Only without a GPU: there it would slow the
# kernels XLA generates.


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts `flag` (it exits on an unknown one): probed in a subprocess, once
    per run, since pytest-xdist's workers inherit the XLA_FLAGS set here."""
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"})
    return probe.returncode == 0


if not os.path.exists("/dev/nvidiactl"):
    if "xla_backend_optimization_level" not in _flags:
        _flags = (_flags + " --xla_backend_optimization_level=0").strip()
    if "xla_cpu_use_fusion_emitters" not in _flags and _xla_knows("--xla_cpu_use_fusion_emitters=false"):
        _flags = (_flags + " --xla_cpu_use_fusion_emitters=false").strip()
    os.environ["XLA_FLAGS"] = _flags

# Parallel workers (pytest -n) share the one GPU: none may reserve most of its memory up front.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Tests use the documented default kernel configs: autotuning every test shape would take minutes.
os.environ.setdefault("JAX_MAMBA2_AUTOTUNE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


def _gpu_unavailable_reason():
    try:
        if not any(d.platform == "gpu" for d in jax.devices()):
            return "no CUDA device visible to JAX"
    except RuntimeError as e:  # no backend at all
        return f"no CUDA device: {e}"
    try:
        import cuda.tile  # noqa: F401
    except ImportError:
        return "cuda-tile is not installed"
    return None


# CPU tests that take more than ~5 s each on a 2-core machine (compiles to cubins, emulated kernels, compiled
# training steps) and whose paths a cheaper test of the quick subset also takes (e.g. the export CLI's whole
# cubin set: each kernel's compile stays quick in test_kernels_compile_to_sm90_cubins and
# test_backward_kernels_compile_to_sm90_cubins; train_lm.py: the jit_model example and test_checkpoint.py).
# `-m "not slow"` (the quick subset) keeps the first case of each parametrized one and leaves the rest out;
# the full suite runs them all.
_LONG_TESTS = frozenset({
    "tests/benchmarks/test_conv1d_benchmark.py::test_cli_writes_records_with_errors_against_float32",
    "tests/benchmarks/test_lm_decode.py::test_the_jax_worker_writes_step_times_prefill_and_floors",
    "tests/benchmarks/test_lm_train.py::test_kernels_fold_into_categories_through_the_compiled_module",
    "tests/benchmarks/test_lm_train.py::test_the_jax_worker_writes_a_record_table_and_plot",
    "tests/benchmarks/test_lm_train.py::test_the_model_loss_profiles_only_its_own_ops_as_loss",
    "tests/benchmarks/test_lm_train_mesh.py::test_a_failed_worker_becomes_a_record_with_its_error",
    "tests/benchmarks/test_lm_train_mesh.py::test_the_benchmark_on_two_fake_devices",
    "tests/benchmarks/test_norm_benchmark.py::test_cli_writes_records_with_errors_against_float32",
    "tests/benchmarks/test_sass.py::test_code_fingerprint_is_the_machine_code_alone",
    "tests/benchmarks/test_sass.py::test_loops_command_reports_every_launch_of_the_plan",
    "tests/benchmarks/test_ssd_benchmark.py::test_benchmark_main_writes_records_with_the_fixed_keys",
    "tests/benchmarks/test_ssd_benchmark.py::test_forward_backward_program_runs_the_forward_kernels",
    "tests/benchmarks/test_ssd_benchmark.py::test_loss_weights_are_arguments_of_the_timed_program_not_constants",
    "tests/bridge/test_aot.py::test_aot_export_lowers_forward_and_backward_kernels_for_sm90",
    "tests/bridge/test_compile_ahead.py::test_compile_ahead_notes_the_local_launches_under_shard_map",
    "tests/bridge/test_eager.py::test_eager_forward_matches_float64_scan",
    "tests/bridge/test_nonfinite_cutile.py::test_emulated_cutile_all_finite_call_returns_the_kernels_outputs_bit_for_bit",
    "tests/bridge/test_nonfinite_cutile.py::test_emulated_cutile_confines_nonfinite_values_like_the_scan",
    "tests/bridge/test_nonfinite_cutile.py::test_emulated_cutile_nan_in_one_packed_sequence_leaves_the_next_finite",
    "tests/bridge/test_nonfinite_cutile.py::test_emulated_cutile_nan_without_seq_idx_spares_the_earlier_tokens_of_its_chunk",
    "tests/bridge/test_nonfinite_cutile.py::test_emulated_cutile_recompute_with_a_collective_is_taken_by_every_shard_or_none",
    "tests/bridge/test_nonfinite_cutile.py::test_emulated_cutile_vmap_keeps_the_check_a_branch_and_confines_per_item",
    "tests/bridge/test_norm_ops_emulated.py::test_emulated_block_norms_under_remat_match_the_xla_block",
    "tests/bridge/test_norm_ops_emulated.py::test_emulated_op_forward_and_gradients_match_float64_reference",
    "tests/bridge/test_norm_ops_emulated.py::test_emulated_op_gradients_under_shard_map_match_float64_reference",
    "tests/bridge/test_norm_ops_emulated.py::test_emulated_op_vmap_of_forward_and_gradients_matches_a_loop",
    "tests/bridge/test_ops_emulated.py::test_emulated_op_forward_and_gradients_match_float64_scan",
    "tests/bridge/test_ops_emulated.py::test_emulated_op_gradients_through_the_fused_layouts_match_float64_scan",
    "tests/bridge/test_ops_emulated.py::test_emulated_op_gradients_under_shard_map_match_float64_scan",
    "tests/bridge/test_ops_emulated.py::test_emulated_op_vmap_of_gradients_with_a_gate_matches_a_loop",
    "tests/bridge/test_plumbing.py::test_cutile_forward_is_three_kernel_calls_with_every_feature",
    "tests/bridge/test_plumbing.py::test_cutile_step_traces_the_state_update_into_a_new_state",
    "tests/bridge/test_plumbing.py::test_gate_vjp_matches_autodiff_of_the_gate",
    "tests/bridge/test_tuning.py::test_autotune_finds_every_ssd_plan_of_a_program_and_tunes_each_ahead_of_time",
    "tests/bridge/test_tuning.py::test_cutile_backward_traces_with_the_configs_backward_configs_returns",
    "tests/bridge/test_tuning.py::test_cutile_forward_traces_with_the_configs_forward_configs_returns",
    "tests/bridge/test_tuning.py::test_random_inputs_are_concrete_inside_a_jit_trace",
    "tests/bridge/test_tuning.py::test_random_inputs_match_plan_inputs_with_realistic_values",
    "tests/bridge/test_tuning.py::test_tune_stages_times_each_config_on_its_plan_buffers_and_rezeroes_atomic_sums",
    "tests/bridge/test_tuning.py::test_tuning_cache_concurrent_writers_keep_every_key_and_tune_each_once",
    "tests/flax_layers/test_checkpoint.py::test_checkpoint_loads_mamba_ssm_and_hf_named_state_dicts",
    "tests/flax_layers/test_checkpoint.py::test_checkpoint_save_crash_keeps_the_old_checkpoint",
    "tests/flax_layers/test_checkpoint.py::test_checkpoint_save_load_round_trip_is_exact",
    "tests/flax_layers/test_checkpoint.py::test_checkpoint_truncated_weights_error_names_the_file",
    "tests/flax_layers/test_decode.py::test_bf16_parameter_decode_step_converts_no_weight",
    "tests/flax_layers/test_decode.py::test_greedy_tokens_are_the_uncached_forward_argmax_with_bf16_parameters_up_to_ties",
    "tests/flax_layers/test_lm.py::test_lm_empty_sequence_gives_empty_logits_and_keeps_the_cache",
    "tests/flax_layers/test_lm.py::test_lm_generate_accepts_a_list_prompt",
    "tests/flax_layers/test_lm.py::test_lm_generate_greedy_is_deterministic_and_follows_forward_argmax",
    "tests/flax_layers/test_lm.py::test_lm_generate_sampling_respects_top_k",
    "tests/flax_layers/test_lm.py::test_lm_grads_finite_and_equal_with_remat",
    "tests/flax_layers/test_lm.py::test_lm_prefill_then_steps_match_forward",
    "tests/flax_layers/test_lm.py::test_lm_rejects_bad_inputs",
    "tests/flax_layers/test_lm.py::test_lm_shapes_dtypes_and_init",
    "tests/flax_layers/test_lm.py::test_unrolled_layers_remat_decode_and_generate_like_the_layer_scan",
    "tests/flax_layers/test_loss.py::test_batched_shapes_ignored_labels_and_bad_labels",
    "tests/flax_layers/test_loss.py::test_chunked_loss_and_gradient_equal_the_plain_loss_in_float64",
    "tests/flax_layers/test_loss.py::test_lm_loss_equals_the_loss_of_its_logits_in_float64",
    "tests/flax_layers/test_loss.py::test_padded_columns_are_excluded_and_get_no_gradient",
    "tests/flax_layers/test_loss.py::test_shard_map_over_a_data_axis_sums_the_weight_gradient",
    "tests/flax_layers/test_loss.py::test_vmap_and_checkpoint_compose",
    "tests/flax_layers/test_mamba2.py::test_mamba2_empty_sequence_gives_empty_output_and_keeps_the_cache",
    "tests/flax_layers/test_mamba2.py::test_mamba2_init_matches_mamba_ssm_formulas",
    "tests/flax_layers/test_mamba2.py::test_mamba2_matches_numpy_float64",
    "tests/flax_layers/test_mamba2.py::test_mamba2_param_and_output_shapes_and_dtypes",
    "tests/flax_layers/test_mamba2.py::test_mamba2_prefill_then_steps_match_forward",
    "tests/flax_layers/test_mamba2.py::test_mamba2_seq_idx_equals_separate_sequences",
    "tests/flax_layers/test_mamba2_conv.py::test_one_device_layer_on_the_emulated_kernels_matches_xla",
    "tests/flax_layers/test_sharded_training.py::test_bfloat16_training_matches_one_device_to_bf16_rounding",
    "tests/flax_layers/test_sharded_training.py::test_data_parallel_step_all_reduces_every_gradient_once_and_gathers_nothing",
    "tests/flax_layers/test_sharded_training.py::test_float32_training_matches_one_device",
    "tests/flax_layers/test_sharded_training.py::test_head_parallel_step_reduces_after_out_proj_and_gathers_no_activation",
    "tests/flax_layers/test_sharding.py::test_head_shard_project_moves_activations_for_few_tokens_and_weights_for_many",
    "tests/flax_layers/test_sharding.py::test_shard_model_empty_sequence_gives_empty_logits",
    "tests/flax_layers/test_sharding.py::test_shard_model_grads_match_single_device_with_groups_split",
    "tests/flax_layers/test_sharding.py::test_shard_model_loss_and_grads_match_single_device_on_a_mesh_of_one_axis",
    "tests/flax_layers/test_sharding.py::test_shard_model_lm_matches_single_device_without_all_gather",
    "tests/flax_layers/test_sharding.py::test_shard_model_on_a_model_axis_of_size_one_is_data_parallel",
    "tests/flax_layers/test_sharding.py::test_shard_model_packed_sequences_match_single_device_with_the_layers_unrolled",
    "tests/kernels/test_backward_compile.py::test_backward_kernels_compile_to_sm90_cubins",
    "tests/kernels/test_backward_compile.py::test_backward_matmul_stages_use_wgmma",
    "tests/kernels/test_backward_compile.py::test_whole_chunk_block_passes_at_dstate_64_compile_without_spills",
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_atomic_blocks_of_several_heads_match_scan_vjp",
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_bf16_within_kernel_tolerance",
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_deterministic_mode_matches_scan_vjp",
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_float64_matches_scan_vjp",
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_one_key_block_row_pass_matches_scan_vjp",
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_summing_heads_matches_scan_vjp",
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_with_states_saved_by_the_fused_forward_matches_scan_vjp",
    "tests/kernels/test_causal_conv1d_compile.py::test_conv_backward_default_tile_is_spill_free",
    "tests/kernels/test_causal_conv1d_compile.py::test_conv_forward_default_tile_is_spill_free_with_vector_rows",
    "tests/kernels/test_causal_conv1d_compile.py::test_conv_kernels_compile_to_sm90_cubins",
    "tests/kernels/test_causal_conv1d_emulated.py::test_conv_backward_sums_weight_gradients_per_item",
    "tests/kernels/test_causal_conv1d_emulated.py::test_conv_kernels_at_default_tiles_match_float64_reference",
    "tests/kernels/test_causal_conv1d_emulated.py::test_conv_kernels_in_their_dtype_match_float64_reference",
    "tests/kernels/test_causal_conv1d_emulated.py::test_conv_kernels_match_float64_reference_in_float64",
    "tests/kernels/test_causal_conv1d_emulated.py::test_conv_kernels_without_activation_match_float64_reference",
    "tests/kernels/test_compile.py::test_chunk_scan_default_at_chunk_64_is_a_spill_free_state_loop",
    "tests/kernels/test_compile.py::test_chunk_scan_state_loop_uses_wgmma_and_tma_without_spills",
    "tests/kernels/test_compile.py::test_export_cli_quick_writes_cubins_and_manifest",
    "tests/kernels/test_compile.py::test_fused_scan_default_uses_wgmma_and_tma_without_spills",
    "tests/kernels/test_compile.py::test_kernels_compile_to_sm90_cubins",
    "tests/kernels/test_compile.py::test_matmul_stages_use_wgmma_and_tma",
    "tests/kernels/test_compile.py::test_state_passes_at_occupancy_4_fit_four_blocks_per_sm_without_spills",
    "tests/kernels/test_rms_norm_emulated.py::test_emulated_backward_loops_over_row_blocks",
    "tests/kernels/test_rms_norm_emulated.py::test_emulated_configs_with_latency_hints_and_wider_blocks_match_float64_reference",
    "tests/kernels/test_rms_norm_emulated.py::test_emulated_forward_and_backward_match_float64_reference",
    "tests/test_conv1d.py::test_aot_export_lowers_the_conv_kernels_for_sm90",
    "tests/test_conv1d.py::test_emulated_cutile_forward_and_gradients_match_float64_reference",
    "tests/test_conv1d.py::test_emulated_cutile_under_shard_map_matches_float64_reference",
    "tests/test_examples.py::test_compare_reference_reports_every_backend",
    "tests/test_examples.py::test_generate_loads_trained_model_and_matches_full_forward",
    "tests/test_examples.py::test_train_lm_refuses_an_earlier_runs_checkpoints_without_resume",
    "tests/test_examples.py::test_train_lm_trains_checkpoints_restores_and_samples",
    "tests/test_nonfinite.py::test_xla_confines_nonfinite_values_like_the_scan",
    "tests/test_nonfinite.py::test_xla_nan_without_seq_idx_spares_the_earlier_tokens_of_its_chunk",
    "tests/test_reference.py::test_ssd_chunked_grads_match_finite_differences",
    "tests/test_reference.py::test_ssd_scan_matches_numpy_loop",
    "tests/test_ssd.py::test_ssd_opaque_backend_vmap_matches_loop",
    "tests/test_ssd_options.py::test_layers_pass_the_kernel_options_to_ssd_and_eval_leaves_them",
})


# Parametrized long tests of which the quick subset keeps the listed cases (another than the first, or none)
# instead of the first: between them, the cases kept cover the paths of the rest (each layout of the forward
# plan, the reference paths); the full suite runs them all.
_QUICK_CASES = {
    "tests/kernels/test_stages_emulated.py::test_forward_plan_emulated_matches_reference": (
        "seq_idx_across_chunks_4_heads_per_block-float32", "fused_seq_idx_init_saving_states-float32",
        "segmented_seq_idx_resets_init_groups_z-bfloat16"),
    "tests/kernels/test_stages_emulated.py::test_state_update_plan_emulated_matches_reference": (
        "bfloat16-bfloat16",),
    # The fused and segmented forwards stay quick in test_stages_emulated.py, the fused forward's saved
    # states feeding the backward in test_backward_emulated.py, the op's glue in the test above.
    "tests/bridge/test_ops_emulated.py::test_emulated_op_gradients_through_the_fused_layouts_match_float64_scan": (),
    # Summing heads' gradients is the plain path of test_backward_plan_emulated_float64_matches_scan_vjp.
    "tests/kernels/test_backward_emulated.py::test_backward_plan_emulated_summing_heads_matches_scan_vjp": (),
    # The layer on the emulated kernels stays quick under remat and in one program (the in-place conv); the
    # emulated ops under shard_map in test_conv1d.py, the xla layer's in test_sharding.py.
    "tests/flax_layers/test_mamba2_conv.py::test_sharded_layer_on_the_emulated_kernels_matches_one_device": (),
    # The confinement of non-finite values on the emulated kernels stays quick in the plain call and the step.
    "tests/bridge/test_nonfinite_cutile.py::test_emulated_cutile_confines_nonfinite_values_under_remat_and_shard_map": (),
    "tests/test_reference.py::test_ssd_vmap_over_leading_axis_matches_loop": ("scan",),
    "tests/test_reference.py::test_ssd_chunked_low_precision_matches_float64_scan": ("f32",),
}


def _mark_long_tests_slow(items) -> None:
    first_case_seen = set()
    for item in items:
        function, _, case = item.nodeid.partition("[")
        if function in _QUICK_CASES:
            if case[:-1] not in _QUICK_CASES[function]:
                item.add_marker(pytest.mark.slow)
            continue
        if function not in _LONG_TESTS:
            continue
        if "[" in item.nodeid and function not in first_case_seen:
            first_case_seen.add(function)
            continue
        item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config, items):
    _mark_long_tests_slow(items)
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_kernel_compiles_left_over_from_the_previous_test():
    """A test that only traces a cuTile program (jaxpr and HLO checks) leaves its launches noted for
    concurrent compilation; the next test that lowers one must not compile them as well."""
    yield
    try:
        from jax_mamba2.bridge import compile_ahead
    except ImportError:  # no cuda-tile: nothing is ever noted
        return
    compile_ahead.discard_pending()
