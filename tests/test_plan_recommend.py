"""The layout search and the seeds' recommendation rule on the seeds' own scenarios."""

from __future__ import annotations

from paratrain.plan.cluster import GB, cluster_preset, cluster_with
from paratrain.plan.layout import Layout, Workload
from paratrain.plan.model import ModelSpec, model_preset
from paratrain.plan.recommend import candidate_layouts, plan

SEEDS = cluster_preset("seeds-80gb-nvlink300-ib50-1e14")


def dp_only(cluster, zeros=(0, 1, 2, 3)) -> list[Layout]:
    return [Layout(dp=cluster.gpus, zero=z) for z in zeros]


def test_13b_with_40gb_activations_only_zero3_fits():
    # Seeds self-test Q2: with 40 GB of activations per GPU only ZeRO-3 (26 + 40 GB) fits.
    w = Workload(activation_bytes_override=40 * GB)
    result = plan(model_preset("13b"), SEEDS, w, dp_only(SEEDS))
    fits = {e.layout.zero: e.fits for e in result.estimates}
    assert fits == {0: False, 1: False, 2: False, 3: True}
    assert result.recommended.layout == Layout(dp=8, zero=3)
    assert result.recommended.memory_bytes == 66 * GB
    z1 = next(e for e in result.estimates if e.layout.zero == 1)
    assert "111.50 GB" in z1.reason  # 71.5 + 40


def test_13b_over_the_whole_search_still_picks_zero3_before_tp():
    # ZeRO-3 comes before tensor parallelism in the seeds' rule even though TP fits too.
    w = Workload(activation_bytes_override=40 * GB)
    result = plan(model_preset("13b"), SEEDS, w)
    assert result.recommended.layout == Layout(dp=8, zero=3)
    assert any(e.fits and e.layout.tp > 1 for e in result.estimates)


def test_model_that_fits_as_plain_dp_gets_plain_dp_and_no_sharding_warning():
    small = ModelSpec("1b", n_params=10**9, seq_len=1024)
    result = plan(small, SEEDS, Workload(activation_bytes_override=10 * GB))
    assert result.recommended.layout == Layout(dp=8)
    assert result.warnings == [] or all("ZeRO" not in w for w in result.warnings)


def test_7b_slightly_over_gets_zero1():
    # 7B: DP needs 112 GB; ZeRO-1's 38.5 GB fits with 30 GB of activations.
    w = Workload(activation_bytes_override=30 * GB)
    result = plan(model_preset("7b"), SEEDS, w)
    assert result.recommended.layout == Layout(dp=8, zero=1)
    assert (
        "ZeRO-1/2" in result.explanation and "Plain DP on 8 GPUs is rejected" in result.explanation
    )


def test_175b_without_zero3_needs_tp_within_a_node_and_pp_across_nodes():
    cluster = cluster_with(cluster_preset("a100-80gb-nvlink300-ib25"), gpus=128)
    w = Workload(micro_batch=1, global_batch=512)
    result = plan(model_preset("175b"), cluster, w, candidate_layouts(cluster, fixed={"zero": 1}))
    best = result.recommended.layout
    assert best.pp > 1 and best.tp == cluster.gpus_per_node
    for e in result.estimates:
        if e.layout.tp > cluster.gpus_per_node:
            assert not e.fits and "spans nodes" in e.reason
    # With ZeRO-3 allowed the memory-first rule takes tp x ZeRO-3, and says what is faster.
    result = plan(model_preset("175b"), cluster, w)
    assert result.recommended.layout.zero == 3 and result.recommended.layout.pp == 1
    assert any("the rule picks by memory" in x for x in result.warnings)


def test_rejected_layouts_carry_reasons():
    result = plan(model_preset("70b"), SEEDS, Workload())
    rejected = [e for e in result.estimates if not e.fits]
    assert rejected and all(e.reason and not e.reason.startswith("fits") for e in rejected)
    pp_zero3 = [e for e in result.estimates if e.layout.pp > 1 and e.layout.zero == 3]
    assert pp_zero3 and all("ZeRO-3 with pipeline" in e.reason for e in pp_zero3)
    # ZeRO-2 with a pipeline runs (the runtime takes it with either accumulation option):
    # it is costed, not refused.
    pp_zero2 = [e for e in result.estimates if e.layout.pp > 1 and e.layout.zero == 2]
    assert pp_zero2 and not any("pipeline" in e.reason for e in pp_zero2)


def test_seeds_warnings_few_gpus_and_already_fits():
    two = cluster_with(SEEDS, gpus=2, gpus_per_node=2)
    small = ModelSpec("1b", n_params=10**9, seq_len=1024)
    result = plan(small, two, Workload(global_batch=8), [Layout(dp=2, zero=3)])
    text = " ".join(result.warnings)
    assert "only 2 GPUs" in text
    result = plan(small, two, Workload(global_batch=8), [Layout(dp=2), Layout(dp=2, zero=3)])
    assert result.recommended.layout == Layout(dp=2)


def test_warning_small_messages_across_nodes_and_few_tokens():
    cluster = cluster_with(SEEDS, gpus=64, utilisation=1.0)
    tiny = ModelSpec("tiny", n_layer=64, d_model=256, n_head=4, vocab_size=256, seq_len=128)
    result = plan(tiny, cluster, Workload(global_batch=64), [Layout(dp=64, zero=3)])
    text = " ".join(result.warnings)
    assert "latency-bound" in text and "exceeds compute" in text


def test_candidates_cover_every_factorisation_once():
    cluster = cluster_with(SEEDS, gpus=16)
    layouts = candidate_layouts(cluster, schedule="1f1b")
    assert len(set(layouts)) == len(layouts)
    shapes = {(lay.tp, lay.cp, lay.pp, lay.dp) for lay in layouts}
    powers = (1, 2, 4, 8, 16)
    expected = {
        (t, c, p, 16 // (t * c * p))
        for t in powers
        for c in powers
        for p in powers
        if 16 % (t * c * p) == 0
    }
    assert shapes == expected
    assert all(lay.zero == 0 for lay in layouts if lay.dp * lay.cp == 1)
    assert {lay.ep for lay in layouts} == {1}  # a dense model: no expert parallelism


def test_json_entries_carry_the_issue_keys():
    result = plan(model_preset("7b"), SEEDS, Workload())
    d = result.as_dict()
    assert {"inputs", "layouts", "recommended"} <= set(d)
    keys = {
        "dp",
        "tp",
        "pp",
        "zero",
        "schedule",
        "model_state_bytes_per_gpu",
        "activation_bytes_per_gpu",
        "comm_bytes_per_gpu",
        "bubble_fraction",
        "step_time_s",
        "fits",
        "reason",
    }
    for entry in d["layouts"]:
        assert keys <= set(entry)
        assert set(entry["model_state_bytes_per_gpu"]) == {
            "params",
            "grads",
            "grad_accumulation",  # ZeRO-2's transient whole gradient (0 elsewhere)
            "optimizer",
            "master",
            "total",
        }
        zero2_k = entry["zero"] == 2 and (entry["microbatches"] or 0) > 1
        assert (entry["zero2_alternative"] is not None) == zero2_k
        assert entry["zero2_accumulate"] == ("shard" if entry["zero"] == 2 else None)
