"""Which tests train which mode combination, and which accepted combinations no test
trains: the hand-kept half of scripts/combination_table.py, which checks both."""

# --- which tests train which combination ---------------------------------------------
# test -> the modes it trains together, one set per layout (a layout covers every
# combination of its modes). A test counts when it trains the layout for several steps
# and checks what came out: equal to one process, within a stated bound of float32, a
# restart or resume equal to the run without it, or (test_default_device) a save and a
# resume whose losses repeat with every allocation checked. Tests that train a layout but
# check only bytes or memory (test_zero_accounting, test_prediction) are not named. A
# named test must exist: its file, function and, in brackets, parametrisation id (ast).
COMPOSITION = "test_composition.py::test_layouts_match_single_process"
ZERO = "test_zero_training.py::test_zero_layouts_match_single_process"
LLAMA = "test_llama.py::test_llama_layouts_match_single_process"
PIPELINE = "test_pipeline_training.py::test_pipeline_through_the_loop_matches_single_process"
TIED = "test_tied_weights.py::test_tied_weights_train_equal_to_one_process"
DEVICE = "test_default_device.py::test_training_allocates_nothing_on_the_default_device"
PAIRS = "test_mode_pairs.py::test_mode_layouts_match_single_process"
LOW = "test_mode_pairs.py::test_low_precision_layouts_track_float32"
CP = "test_context_parallel_training.py::test_context_parallel_layouts_match_single_process"
KILLED = "test_reliability_cli.py::test_a_killed_worker_is_restarted_and_the_run_ends_as_if_nothing_happened"  # noqa: E501
DILOCO = "test_diloco.py::test_diloco_equals_the_algorithm_in_one_process"
RESUMED = "test_compression_training.py::test_a_checkpoint_resumes_bitwise_with_the_error_buffers"
COVERAGE: dict[str, list[set[str]]] = {
    "test_compression_training.py::test_where_compression_changes_nothing_the_run_equals_one_process": [  # noqa: E501
        {"compress"},
        {"compress", "zero2"},
    ],
    f"{RESUMED}[zero2-int8]": [{"compress", "zero2"}],
    f"{RESUMED}[dp-powersgd]": [{"compress"}],
    f"{RESUMED}[hsdp-sign]": [{"compress", "zero1"}],
    f"{DILOCO}[dp 2, groups of 1, Nesterov]": [{"diloco"}],
    f"{DILOCO}[dp 4, ZeRO-1 groups of 2, averaging]": [{"diloco", "zero1"}],
    f"{DILOCO}[dp 2 x pp 2, ZeRO-1, momentum]": [{"diloco", "zero1", "1f1b"}],
    f"{DILOCO}[dp 2 x tp 2, ZeRO-3]": [{"diloco", "tp", "zero3"}],
    f"{DILOCO}[dp 4, ZeRO-2 over our ring]": [{"diloco", "zero2", "ring"}],
    f"{DILOCO}[dp 2 x pp 2, gpipe]": [{"diloco", "gpipe"}],
    f"{DILOCO}[dp 2 x cp 2, ring attention]": [{"diloco", "cp"}],
    f"{COMPOSITION}[4]": [{"dp", "sp", "rc-full"}, {"tp", "1f1b", "rc-full"}],
    f"{COMPOSITION}[8]": [
        {"dp", "tp", "interleaved"},
        {"dp", "tp", "1f1b", "rc-full"},
        {"tp", "gpipe"},
        {"dp", "1f1b"},
        {"dp", "sp"},
    ],
    f"{ZERO}[4]": [
        {"zero2", "tp"},
        {"zero2", "1f1b"},
        {"zero1", "sp"},
        {"zero2", "sp"},
        {"zero3", "sp"},
        {"zero3", "rc-full"},
    ],
    f"{ZERO}[8]": [{"zero1", "tp", "1f1b"}, {"zero2", "tp", "1f1b"}],
    "test_zero_training.py::test_bfloat16_with_zero_trains_close_to_float32": [{"zero1", "bf16"}],
    "test_mixed_precision.py::test_bf16_tracks_fp32_within_a_stated_bound": [
        {"dp", "bf16"},
        {"zero1", "bf16"},
        {"zero2", "bf16"},
        {"zero3", "bf16"},
    ],
    "test_mixed_precision.py::test_fp16_training_with_loss_scaling_tracks_fp32": [
        {"zero1", "fp16"}
    ],
    "test_mixed_precision.py::test_a_bf16_pipeline_sends_bf16_activations_and_tracks_fp32": [
        {"bf16", "1f1b"}
    ],
    f"{LLAMA}[2]": [{"llama", "dp"}, {"llama", "zero3"}, {"llama", "sp"}, {"llama", "1f1b"}],
    f"{LLAMA}[8]": [{"llama", "dp", "tp", "1f1b"}],
    "test_train_cli.py::test_the_llama_preset_trains_from_the_cli[layout0]": [{"llama", "tp"}],
    "test_train_cli.py::test_the_llama_preset_trains_from_the_cli[layout1]": [{"llama", "1f1b"}],
    f"{PIPELINE}[4]": [{"dp", "1f1b"}, {"dp", "interleaved"}],
    "test_recompute.py::test_training_with_selective_recomputation_equals_training_without": [
        {"dp", "rc-sel"},
        {"zero3", "rc-sel"},
        {"sp", "rc-sel"},
        {"sp", "rc-full"},
        {"zb-h1", "llama", "rc-sel"},
    ],
    "test_async_checkpoint.py::test_recompute_full_in_async_gives_the_losses_of_a_run_without": [
        {"async", "rc-full"}
    ],
    "test_data_parallel_equivalence.py::test_our_algorithms_train_like_native[ring]": [
        {"dp", "ring"}
    ],
    "test_data_parallel_equivalence.py::test_our_algorithms_train_like_native[tree]": [
        {"dp", "tree"}
    ],
    f"{TIED}[4]": [{"zero1", "1f1b"}, {"zero2", "1f1b"}, {"zero3", "tp"}, {"tp", "1f1b"}],
    f"{DEVICE}[dp]": [{"dp", "resume"}],
    f"{DEVICE}[dp-ring]": [{"dp", "ring", "resume"}],
    f"{DEVICE}[zero1]": [{"zero1", "resume"}],
    f"{DEVICE}[zero2]": [{"zero2", "resume"}],
    f"{DEVICE}[zero3]": [{"zero3", "resume"}],
    f"{DEVICE}[tp-sp]": [{"sp", "resume"}],
    f"{DEVICE}[pp-1f1b]": [{"1f1b", "resume"}],
    f"{DEVICE}[pp-interleaved]": [{"interleaved", "resume"}],
    f"{DEVICE}[3d]": [{"dp", "tp", "1f1b", "resume"}],
    "test_checkpoint.py::test_resume_is_exact_on_the_same_mesh_and_close_on_other_meshes": [
        {"zero2", "tp", "resume"},
        {"zero1", "resume"},
        {"dp", "1f1b", "resume"},
        {"tp", "1f1b", "resume"},
    ],
    f"{PAIRS}[2]": [
        {"zero1", "rc-sel", "llama", "ring"},
        {"zero2", "rc-full", "llama", "tree"},
        {"sp", "tree"},
        {"gpipe", "rc-sel", "llama", "ring"},
        {"interleaved", "rc-full", "llama", "tree"},
        {"1f1b", "rc-sel", "ring"},
        {"1f1b", "tree"},
    ],
    f"{PAIRS}[4]": [
        {"dp", "gpipe", "rc-full", "tree"},
        {"dp", "zb-h1", "ring"},
        {"zero1", "gpipe", "rc-full"},
        {"zero1", "interleaved", "rc-sel", "ring"},
        {"zero1", "zb-h1", "rc-full", "tree"},
        {"zero2", "gpipe", "rc-sel"},
        {"zero2", "interleaved", "ring"},
        {"zero2", "zb-h1"},
        {"tp", "zb-h1", "rc-sel", "ring"},
        {"zero3", "sp", "rc-full", "llama", "ring"},
        {"zero3", "tp", "rc-sel", "tree"},
    ],
    f"{PAIRS}[8]": [{"dp", "tp", "gpipe"}, {"dp", "tp", "zb-h1"}],
    f"{LOW}[2]": [
        {"tp", "bf16", "rc-sel", "ring"},
        {"sp", "bf16", "rc-full", "llama", "tree"},
        {"gpipe", "bf16", "llama"},
        {"interleaved", "bf16"},
        {"zb-h1", "bf16"},
        {"dp", "fp16", "rc-sel", "llama", "ring"},
        {"cp", "bf16", "rc-sel", "llama"},
        {"cp-a2a", "fp16", "tree"},
        {"cp", "fp16", "ring"},
        {"cp-a2a", "bf16", "llama"},
    ],
    f"{LOW}[4]": [
        {"zero1", "tp", "bf16"},
        {"tp", "1f1b", "bf16"},
        {"zero3", "sp", "fp16", "ring"},
        {"zero2", "tp", "fp16", "rc-full", "llama", "tree"},
    ],
    "test_mode_pairs.py::test_one_worker_async_matches_single_process": [
        {"async", "rc-sel", "llama"}
    ],
    "test_mode_pairs.py::test_a_resumed_layout_continues_as_the_uninterrupted_run": [
        {"gpipe", "rc-full", "tree", "bf16", "resume"},
        {"zb-h1", "rc-sel", "resume"},
        {"dp", "fp16", "resume"},
        {"cp", "resume"},
        {"cp-a2a", "llama", "resume"},
    ],
    CP: [
        {"cp", "dp", "rc-full", "tree"},
        {"cp", "zero3"},
        {"cp", "zero2"},
        {"cp", "zero1", "llama"},
        {"cp-a2a", "dp"},
        {"cp", "tp"},
        {"cp-a2a", "zero2", "llama", "rc-sel", "ring"},
        {"cp", "sp", "llama"},
        {"cp-a2a", "tp", "rc-full", "tree"},
        {"cp", "1f1b", "rc-sel", "ring"},
        {"cp", "gpipe"},
        {"cp", "zb-h1"},
        {"cp-a2a", "1f1b", "zero1"},
        {"cp-a2a", "gpipe"},
        {"cp-a2a", "zb-h1"},
        {"cp", "interleaved"},
        {"cp-a2a", "zero3"},
        {"cp-a2a", "sp"},
        {"cp-a2a", "interleaved"},
    ],
    "test_context_parallel_training.py::test_context_tensor_and_data_parallel_together_match_single_process": [  # noqa: E501
        {"cp", "dp", "tp", "sp"},
        {"cp", "tp", "1f1b"},
    ],
    "test_context_parallel_training.py::test_paratrain_train_cp_2_matches_single_process": [
        {"cp", "llama"}
    ],
    "test_compile.py::test_compiled_layouts_match_single_process": [
        {"dp", "compile"},
        {"zero1", "compile"},
        {"zero2", "compile"},
        {"zero3", "compile"},
        {"sp", "compile"},
        {"tp", "rc-full", "compile"},
        {"1f1b", "compile"},
    ],
    "test_moe_training.py::test_expert_parallel_with_zero_buckets_and_tp_equals_one_process": [
        {"ep", "zero1", "ring"},
        {"ep", "zero2", "tree"},
        {"ep", "zero3"},
        {"ep", "tp"},
        {"ep", "zero1", "bf16"},
        {"ep", "zero1", "1f1b"},
        {"ep", "zero2", "gpipe"},
        {"ep", "zb-h1"},
        {"ep", "zero2", "rc-full"},
        {"ep", "zb-h1", "rc-sel"},
    ],
    f"{KILLED}[sync]": [{"dp", "restarts"}],
    f"{KILLED}[async]": [{"async", "restarts"}],
}
# Accepted by the checks, but no test trains them: shown as such, not claimed. Adding a
# test to COVERAGE removes its combinations from here (the generation says which).
UNTESTED = {
    tuple(c.split("+"))
    for c in """
zero1+restarts zero2+restarts zero3+restarts tp+restarts sp+restarts gpipe+restarts
1f1b+restarts interleaved+restarts zb-h1+restarts bf16+restarts
fp16+restarts rc-full+restarts rc-sel+restarts ring+restarts tree+restarts
llama+restarts resume+restarts
cp+restarts cp-a2a+restarts
gpipe+compile interleaved+compile bf16+compile
fp16+compile ring+compile tree+compile llama+compile resume+compile restarts+compile
ep+restarts
diloco+bf16 diloco+fp16 diloco+compile diloco+interleaved diloco+zb-h1 diloco+llama
diloco+rc-full diloco+rc-sel diloco+restarts diloco+sp diloco+tree diloco+cp-a2a
compress+1f1b compress+bf16 compress+compile compress+cp compress+cp-a2a compress+ep
compress+gpipe compress+interleaved compress+llama compress+rc-full compress+rc-sel
compress+restarts compress+resume compress+ring compress+sp compress+tp compress+tree
compress+zb-h1
""".split()
}
