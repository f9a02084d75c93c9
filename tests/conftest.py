"""Shared test settings: float32 everywhere, CPU only, deterministic.

XLA:CPU's backend compile is most of the suite's time (tiny models run in milliseconds,
their programs compile in seconds), so tests compile with JAX's
``jax_disable_most_optimizations`` (backend optimisation level 0, LLVM's expensive passes
off): a quarter less CPU time, the same programs. The environment variable reaches the
subprocesses that tests start (multi-device runs, the command line), which read it at
start-up; ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` turns it off. The suite's XLA flags
(``tests/flags.py``: the older, faster-compiling CPU fusion emitters) join ``XLA_FLAGS``
the same way, before JAX starts a backend. JAX's persistent compilation cache goes to one
new directory per run (``tests/flags.py``, removed at exit), shared by the xdist workers and
the tests' subprocesses, so a program compiled once in the run is loaded, not compiled
again, by another test or process; ``JAX_COMPILATION_CACHE_DIR`` set beforehand wins.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

from tests.flags import compilation_cache_dir, with_compile_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_compile_flags(os.environ.get("XLA_FLAGS", ""))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the environment it reads)

jax.config.update(
    "jax_disable_most_optimizations",
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() not in ("0", "false", "no", "off"),
)
# Read from the environment when JAX is imported, which may have happened already.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes",
    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)

# The slowest files (CPU seconds of a full run, benchmarks/HISTORY.md "2026-12-02: the suite at
# 8-8.5 minutes"; test_scan before test_expert_parallel: 70 and 64 CPU s alone, HISTORY.md
# "2026-12-06: the test suite's tiers"), first: pytest-xdist (`make test`: --dist loadfile
# --no-loadscope-reorder) hands each worker one file at a time in collection order, so
# starting with the longest lets the workers end together (longest-processing-time-first)
# instead of one running a long file alone at the end. The other files follow in their
# usual order.
SLOWEST_FIRST = (
    "rl/test_trainer.py",
    "rl/test_micro_batches.py",
    "models/test_scan.py",
    "models/test_expert_parallel.py",
    "test_engine.py",
    "rl/test_packing.py",
    "rl/test_mesh.py",
    "rl/test_async_rl.py",
    "benchmarks/test_scale_sim.py",
    "test_multihost.py",
    "rewards/test_code.py",
    "rl/test_async_engine.py",
    "rl/test_tasks.py",
    "test_sampling.py",
    "models/test_fsdp_grads.py",
    "rl/test_async_generation.py",  # of test_async_rl, split
)


# The tests marked ``slow``, which `make test-fast` (``-m "not slow"``) leaves out and `make
# test` runs: the end-to-end runs (training loops, the command line, experiments) and the
# simulated meshes (subprocesses of 2-8 devices). Whole files, then single tests of other
# files (by function name: every parametrisation); files by their path under tests/.
SLOW_FILES = {
    "benchmarks/test_scale_sim.py",
    "experiments/test_cli.py",
    "experiments/test_eval.py",
    "models/test_expert_parallel.py",
    "rl/test_lora_rl.py",
    "rl/test_mesh.py",
    "rl/test_resume.py",
    "rl/test_sft.py",
    "rl/test_trainer.py",
    "test_multihost.py",
}
SLOW_TESTS = {
    "experiments/test_ablate.py": {
        "test_a_tiny_sweep_trains_summarises_resumes_and_evaluates",
        "test_a_partial_run_is_resumed_never_counted",
    },
    "experiments/test_critic_error.py": {"test_a_run_is_measured_in_a_copy"},
    "experiments/test_own_data.py": {
        "test_sft_then_rl_on_own_data_with_any_preset",
        "test_tokenizer_command_trains_keeps_and_refuses",  # four runs of the command line
    },
    "experiments/test_reproduce.py": {
        "test_a_continued_sft_start_trains_its_parent_first",
        "test_a_tiny_claim_runs_over_two_starts_end_to_end_and_resumes",
    },
    "models/test_attention.py": {"test_splash_and_blockwise_on_a_mesh"},
    "models/test_fsdp_grads.py": {"test_gradients_reduce_scattered_and_equal_one_device"},
    "models/test_lora.py": {"test_adapters_on_expert_parallel_and_fsdp_meshes"},
    "models/test_scan.py": {"test_scanned_model_on_an_fsdp_expert_mesh"},
    "rl/test_async_engine.py": {
        "test_engine_slots_on_two_devices_equal_generate_and_compile_once",
        "test_run_async_rl_on_the_paged_engine_trains",
    },
    "rl/test_async_rl.py": {
        "test_run_async_rl_trains_checkpoints_and_resumes",
        "test_run_async_rl_trains_a_critic_recipe_with_value_pretraining_nll_and_resume",
        "test_batches_take_the_prompt_bucket_of_their_longest_prompt",
        "test_mixed_math_and_code_prompts_are_scored_by_their_task",
    },
    "rl/test_critic.py": {
        "test_pretraining_decoupled_gae_nll_and_resume",
        "test_reward_model_then_value_pretraining_then_ppo",
        "test_value_pretraining_targets_are_monte_carlo_returns",
        "test_a_critic_of_its_own_model_starts_from_its_checkpoint",
    },
    "rl/test_iteration.py": {"test_the_stages_compose_to_rl_iteration"},
    "rl/test_micro_batches.py": {"test_micro_batches_on_a_mesh_equal_one_pass"},
    "rl/test_packing.py": {
        "test_packed_update_on_a_mesh_equals_padded",
        "test_trainer_iteration_packed_equals_padded",
    },
    "rl/test_report.py": {"test_a_vapo_run_prints_its_method_and_warm_up_phases"},
    "rl/test_tasks.py": {
        "test_code_jsonl_task_trains_and_scores_programs_against_its_tests",
        "test_custom_verifier_judges_rewards_and_evaluation",
        "test_math_jsonl_task_trains_like_the_same_records_in_memory",
        "test_missed_samples_count_in_no_group_statistic",
        "test_mixed_jsonl_checks_each_sample_with_its_own_task",
        "test_pretrained_model_and_tokenizer_train_on_a_jsonl_task",
        "test_verifier_health_and_the_scoring_deadline_reach_the_metrics",
    },
    "test_compile_once.py": {
        "test_second_process_loads_what_the_first_compiled",
        "test_a_warm_rerun_says_its_programs_came_from_the_cache",
        "test_no_compilation_after_the_first_iteration_of_a_phase",
    },
    "test_engine.py": {
        "test_sharded_engine_on_two_devices_equals_generate",
        "test_synchronous_trainer_streams_its_rows_through_the_engine",
        "test_trainer_replays_the_engines_routing_r3",
    },
    "test_extensions.py": {"test_a_users_objective_and_estimator_train_from_the_command_line"},
    "test_loggers.py": {"test_rl_run_sends_config_samples_and_evaluations_to_each_logger"},
    "test_logprobs.py": {"test_rows_split_over_devices_stay_split"},
    "test_sharding.py": {
        "test_sharded_forward_and_gradients_match_one_device",
        "test_models_are_built_and_loaded_straight_onto_the_mesh",
    },
}
# Also slow: the compile-heavy equivalence checks (a model's programs compiled several times
# over: each dispatch, aggregation, remat policy or decode path against its reference; 3,900
# of the fast tier's 6,100 test-seconds, benchmarks/RESULTS.md "The test suite's folders and
# tiers"). Each file keeps its hand-worked and cheaper cases in the fast tier.
HEAVY_TESTS = {
    "models/test_attention.py": {
        "test_model_blockwise_equals_einsum_logits_and_gradients",
        "test_packed_segments_equal_separate_rows",
    },
    "models/test_lora.py": {
        "test_moe_experts_equal_loop_reference_with_merged_weights",
        "test_zero_b_logits_equal_the_base_exactly",
    },
    "models/test_models.py": {"test_kv_cache_layout_and_forms"},
    "models/test_moe.py": {
        "test_blocked_take_gradient_sums_in_the_parameter_dtype",
        "test_gradients_match_loop_reference_under_replay",
    },
    "models/test_paged.py": {
        "test_paged_decode_equals_dense",
        "test_pool_attention_on_shards_equals_gather",
    },
    "models/test_scan.py": {
        "test_scan_equals_loop",
        "test_every_remat_policy_gives_the_same_gradients",
        "test_scanned_program_does_not_grow_with_depth",
        "test_greedy_generation_equal",
        "test_kv_cache_prefill_then_decode",
    },
    "rl/test_async_engine.py": {
        "test_behaviour_log_probs_follow_the_version_of_every_token",
        "test_greedy_equals_the_synchronous_sampler_and_rows_wait_for_pages",
        "test_stop_sequences_end_rows_as_in_the_synchronous_sampler",
        "test_take_stops_on_request_and_the_generator_closes",
    },
    "rl/test_async_generation.py": {
        "test_greedy_without_updates_equals_the_synchronous_sampler",
        "test_behaviour_log_probs_follow_the_version_of_every_token",
        "test_refill_and_segment_compile_once",
    },
    "rl/test_async_rl.py": {"test_default_prompt_width_fits_every_prompt_of_the_stream"},
    "rl/test_critic.py": {"test_moe_critic_adds_its_load_balancing_loss"},
    "rl/test_learner.py": {
        "test_replayed_routing_reaches_the_update_forward",
        "test_loss_mask_restricts_the_policy_terms",
        "test_an_objective_registered_by_a_user_runs_from_a_recipe",
    },
    "rl/test_micro_batches.py": {
        "test_update_equals_one_pass_for_every_aggregation",
        "test_moe_aux_losses_equal_one_pass",
        "test_policy_loss_shares_sum_to_the_minibatch_loss",
        "test_moe_critic_load_balancing_equals_one_pass",
        "test_gspo_sequence_ratios_equal_one_pass",
        "test_micro_batches_bound_the_update_memory",
        "test_magistral_minibatch_advantages_reach_every_micro_batch",  # the update compiled
        "test_one_compile_per_shape",  # for these alone
    },
    "rl/test_packing.py": {
        "test_log_probs_losses_gradients_equal_padded",
        "test_critic_values_and_loss_equal_padded",
    },
    "test_engine.py": {
        "test_greedy_equals_generate",
        "test_small_budget_waits_not_truncates",
        "test_batched_admissions_give_the_same_rollout",
        "test_log_probs_equal_full_forward",  # of the batched admissions' runs
        "test_stop_sequences_and_no_routing_capture",
        "test_should_stop_ends_a_generation_in_progress",  # then equals generate's rollout
        "test_a_host_loop_without_progress_raises",
    },
    "test_bad_input.py": {"test_a_start_still_being_trained_is_refused"},
    "test_checkpoint.py": {"test_a_target_of_other_shapes_is_refused_before_any_read"},
    "test_logprobs.py": {"test_entropy_of_peaked_distributions"},
    "test_losses.py": {"test_bool_int_and_float_masks_agree"},
    "test_sampling.py": {
        "test_decode_dispatch_gives_the_same_rollout",
        "test_decode_segments_give_the_same_rollout",
        "test_greedy_equals_transformers_generate",
        "test_log_probs_equal_full_forward",
        "test_routing_replay_reproduces_log_probs",
        "test_greedy_equals_stepwise_argmax",
        "test_group_samples_top_k_top_p_eos_min_new_tokens",
        "test_padded_equals_unpadded",
    },
}


# Also slow: the tests that start processes and wait on their limits (the sandbox, the
# verifier's server and workers, batch scoring's pool), import torch and transformers for a
# reference, interpret a Pallas kernel, or count a paper-scale model's parameters (about a
# third of the fast tier's wall time; benchmarks/RESULTS.md "The test suite's folders and
# tiers").
PROCESS_FILES = {
    "models/test_hf.py",
    "models/test_lora_hf.py",
    "rewards/test_batch.py",
    "rewards/test_code.py",
    "rewards/test_killable.py",
    "rewards/test_sandbox.py",
    "rewards/test_verifier_processes.py",
}
PROCESS_TESTS = {
    "models/test_paged.py": {
        "test_pallas_attention_in_the_model_decodes_like_the_gather",
        "test_pallas_kernel_interpreted_equals_gather",
        "test_pallas_kernel_reads_pages_as_bfloat16_so_it_takes_bfloat16_pools_only",
    },
    "models/test_presets.py": {
        "test_qwen3_30b_a3b_parameter_count",
        "test_qwen3_8b_parameter_count",
    },
    "rewards/test_testcases.py": {"test_asserts_keep_their_order_and_decorators_when_cut_or_split"},
    "test_checkpoint.py": {"test_a_second_process_is_refused_the_workdir"},
    "test_extensions.py": {"test_an_import_that_fails_is_one_line_naming_it"},
    "test_loggers.py": {"test_wandb_offline_receives_config_records_and_tables"},
}


HERE = os.path.dirname(os.path.abspath(__file__))


def listed_name(item) -> str:
    """``item``'s (a collected test's) file as the lists above name it: its path under
    ``tests/``, with ``/``."""
    return os.path.relpath(item.path, HERE).replace(os.sep, "/")


SLOW_GROUPS = (SLOW_TESTS, HEAVY_TESTS, PROCESS_TESTS)


def is_slow(item) -> bool:
    """Whether ``item`` (a collected test) is one of the slow or heavy tests above."""
    name = listed_name(item)
    return (
        name in SLOW_FILES
        or name in PROCESS_FILES
        or any(item.originalname in tests.get(name, ()) for tests in SLOW_GROUPS)
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item):
            item.add_marker("slow")
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(listed_name(item), len(rank)))  # stable: files whole
