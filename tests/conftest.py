"""Test setup: 8 fake CPU devices, created before anything imports JAX.

Every parallel layout (dp=8, fsdp=8, dp=2,fsdp=2,tp=2, ...) is tested on these devices; if
JAX were imported first the flag would be ignored and those tests would run on one device,
so the count is asserted rather than assumed.
"""

import os
import signal
import sys
import tempfile
from pathlib import Path

# --xla_backend_optimization_level=0: LLVM compiles the kernels without its optimisation passes.
# The suite is compile-bound (tiny models) and the HLO every test reads is the same; only the
# machine code is slower (test_parallel's layout parity: 54 s -> 43 s on 2 cores). Subprocesses
# inherit it (tests/helpers.py's xla_flags keeps it for those that set their own device count).
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"])
# JAXGPT_TEST_GPU=1 (scripts/gpu_checks.sh) also makes a CUDA GPU visible, as the second platform,
# so CPU stays the default backend and every other test still runs on the 8 CPU devices; the
# cuDNN attention parity test then runs on the GPU instead of being skipped.
if os.environ.get("JAXGPT_TEST_GPU") == "1":
    os.environ["JAX_PLATFORMS"] = "cpu,cuda"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # subprocesses share the GPU
else:
    os.environ["JAX_PLATFORMS"] = "cpu"
# The bundled corpus is prepared once per test session into a private cache (subprocesses inherit it).
os.environ.setdefault("JAXGPT_CACHE", tempfile.mkdtemp(prefix="jaxgpt-test-cache-"))
# No persistent compilation cache (it once sped up the kill/resume tests): in jax 0.12 an XLA:CPU
# step read back from it can deadlock its collectives (jaxgpt/parallel/distributed.py), which
# aborted whole test workers.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# A suite started in the background of a non-interactive shell (`nohup ... &`, some CI runners)
# inherits SIGINT ignored, and so would every process it starts: the Ctrl-C tests would then test
# nothing (a child Python keeps an inherited SIG_IGN). Python's own handler here is reset to the
# default action in every child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 fake CPU devices; was JAX imported before conftest?"


def _compile_each_module_once(keep: int = 96) -> None:
    """Compiles shared across the tests of a worker: XLA compiles one module (text, options and
    devices the same) to one executable, so a module compiled once here is not compiled again. Two
    train() calls of one config (a run, then its resume) build new jitted functions that JAX's own
    caches do not match, and the suite is compile-bound. This is JAX's persistent compilation cache
    kept in memory, where an executable is never serialized: an XLA:CPU executable read back from
    disk can lose the order of its collectives (jaxgpt/parallel/distributed.py), so that cache stays
    off. Modules with host callbacks are compiled every time (their callbacks are per executable).
    Subprocesses (the CLI runs) compile as users' runs do."""
    import collections
    import hashlib

    from jax._src import compiler

    compile_and_load = compiler.backend_compile_and_load
    compiled: collections.OrderedDict[bytes, object] = collections.OrderedDict()

    def once(backend, module, executable_devices, options, host_callbacks):
        if host_callbacks:
            return compile_and_load(backend, module, executable_devices, options, host_callbacks)
        key = hashlib.sha256(b"\0".join([
            str(module).encode(), options.SerializeAsString(), repr(sorted(options.env_option_overrides)).encode(),
            repr((id(backend), [(d.platform, d.id) for d in executable_devices])).encode()])).digest()
        if key in compiled:
            compiled.move_to_end(key)
            return compiled[key]
        executable = compile_and_load(backend, module, executable_devices, options, host_callbacks)
        compiled[key] = executable
        if len(compiled) > keep:
            compiled.popitem(last=False)
        return executable

    compiler.backend_compile_and_load = once


_compile_each_module_once()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture(scope="session")
def shakespeare_dir() -> Path:
    from jaxgpt import data
    return data.resolve_data_dir("shakespeare")


# The quick tier, `python -m pytest -m quick` (README): a few fast tests from every test file, so
# an edit-test loop touches every module (the default run end to end, through the docs test) in
# under 3 minutes on 2 cores. A file's name alone takes the whole file. CI runs everything.
# tests/test_readme.py checks that every test file has its entry here.
QUICK = [
    "test_chat.py::test_builtin_templates_gpt2_chatml_and_llama3",
    "test_checkpoint.py::test_non_finite_restored_parameters_count_as_damage",
    "test_checkpoint.py::test_a_checkpoint_directory_that_became_read_only_stops_the_save_with_one_line",
    "test_cli.py::test_a_device_out_of_memory_is_one_line",
    "test_cli.py::test_ctrl_c_while_importing_is_one_line",
    "test_config.py",
    "test_context.py::test_each_device_holds_an_early_and_a_late_chunk",
    "test_cost.py",
    "test_ops.py::test_every_trick_is_in_the_matrix",
    "test_ops.py::test_model_ops_takes_its_forms_or_tricks_and_says_so_in_one_line_when_wrong",
    "test_ops.py::test_norm_value_and_gradients_match_autodiff",
    "test_data.py",
    "test_docs.py::test_the_first_example_runs[README.md]",
    "test_docs.py::test_the_exit_code_table_is_the_codes_the_cli_defines",
    "test_docs.py::test_the_config_reference_is_what_its_generator_writes",
    "test_documents.py::test_no_gradient_reaches_another_documents_tokens[rope_reset]",
    "test_eval.py::test_accuracy_and_length_normalisation_as_lm_eval_harness",
    "test_eval.py::test_task_config_is_checked_before_compiling",
    "test_fp8_choice.py",
    "test_gpu_compile.py::test_without_the_plugin_the_command_says_what_to_install",
    "test_hf.py::test_cli_missing_dir_is_one_line",
    "test_hf.py::test_init_from_hf_is_refused_before_the_run_starts_where_no_class_holds_the_model",
    "test_imports.py",
    "test_integrity.py::test_input_shapes_people_have",
    "test_jobset.py",
    "test_kernels.py::test_online_logsumexp_matches_two_passes",
    "test_kernels.py::test_gelu_keeping_its_derivative_rounds_the_gradient_twice_at_most",
    "test_lock.py::test_lock_files_per_process_and_what_a_refused_command_leaves",
    "test_manual.py::test_per_shard_matches_one_device",
    "test_model.py::test_gpt2_small_has_gpt2_parameter_count",
    "test_model.py::test_bf16_compute_stays_close_to_fp32",
    "test_modern.py::test_defaults_are_gpt2_and_counts_match_the_tree",
    "test_modern.py::test_muon_takes_the_block_matrices_and_adamw_the_rest",
    "test_moe.py::test_routing_drops_and_losses_match_numpy",
    "test_moe.py::test_impossible_moe_combinations",
    "test_moe_dropless.py::test_dropless_equals_capacity_when_nothing_is_dropped",
    "test_multihost.py::test_launcher_arguments_are_checked_in_one_line",
    "test_parallel.py::test_parameters_sharded_as_the_table_says",
    "test_pipeline.py::test_bad_pipeline_layouts_are_refused_before_compiling",
    "test_plan.py::test_a_step_over_an_accelerators_memory_is_refused_before_it_runs",
    "test_prepare.py::test_windows_cross_shard_boundaries_like_one_file",
    "test_prepare.py::test_bad_inputs_are_one_clear_line",
    "test_qwen3.py::test_round_trip_exact_and_numpy_qwen3_gives_our_logits",
    "test_readme.py",
    "test_report.py::test_a_non_finite_time_in_events_is_an_unknown_duration",
    "test_report.py::test_bad_profile_steps_is_a_user_error",
    "test_resilience.py",
    "test_sample.py::test_top_k_and_top_p_filters",
    "test_sample.py::test_sample_cli_missing_run",
    "test_search.py::test_candidates_are_the_valid_ones_in_a_fixed_order",
    "test_search.py::test_the_memory_lines_say_what_a_layout_needs_of_what_a_gpu_has",
    "test_sft.py::test_a_token_outside_an_assistant_turn_has_exactly_zero_gradient",
    "test_sft.py::test_packed_conversations_score_as_each_alone",
    "test_tokenizers.py::test_ids_equal_autotokenizers_and_an_export_keeps_its_identity",
]


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (tests/conftest.py QUICK): `python -m pytest -m quick`")


def pytest_collection_modifyitems(config, items):
    for item in items:
        file, _, name = item.nodeid.removeprefix("tests/").partition("::")
        if any(q in (file, f"{file}::{name}", f"{file}::{name.split('[')[0]}") for q in QUICK):
            item.add_marker(pytest.mark.quick)
