"""Configuration: TOML + CLI precedence, batch arithmetic, and every refusal of bad input.

Each bad input must give exit status 2 and one line on stderr naming the bad value, with
no traceback, before any worker starts (these tests would hang or take seconds otherwise).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from paratrain.cli import build_parser, main
from paratrain.commands.config_flags import config_from_args
from paratrain.config import EFFECTS, SECTIONS, RunConfig
from paratrain.config.toml_file import apply_overrides, from_toml_text, to_toml
from paratrain.validate import resolve_and_check


@pytest.fixture(autouse=True)
def _in_a_temporary_directory(tmp_path, monkeypatch):
    """A bad input that slipped through would start training: keep its run dir out of the repo."""
    monkeypatch.chdir(tmp_path)


def test_cli_overrides_file_overrides_default(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 50\nlr = 1\n[model]\nn_layer = 2\n")
    args = build_parser().parse_args(["train", "--config", str(path), "--steps", "80"])
    cfg = config_from_args(args)
    assert cfg.train.steps == 80  # CLI beats file
    assert cfg.train.lr == 1.0  # file beats default; a TOML int is accepted as a float
    assert cfg.model.n_layer == 2
    assert cfg.model.d_model == RunConfig().model.d_model  # default


def test_resolved_config_round_trips_through_toml():
    cfg = resolve_and_check(RunConfig(), world_size=2)
    assert from_toml_text(to_toml(cfg)) == cfg


@pytest.mark.parametrize(
    "world, flags, dp, k, g",
    [
        (2, {"global_batch": 16, "micro_batch": 8}, 2, 1, 16),
        (2, {"global_batch": 32, "micro_batch": 4}, 2, 4, 32),
        (4, {"global_batch": 0, "microbatches": 3, "micro_batch": 2}, 4, 3, 24),
        (1, {"global_batch": 16, "micro_batch": 2, "microbatches": 8}, 1, 8, 16),
    ],
)
def test_batch_arithmetic(world, flags, dp, k, g):
    cfg = RunConfig()
    apply_overrides(cfg, {"train": flags}, "test")
    cfg = resolve_and_check(cfg, world)
    assert (cfg.parallel.dp, cfg.train.microbatches, cfg.train.global_batch) == (dp, k, g)


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


BAD_INPUTS = [
    (["--nproc", "4", "--dp", "3"], "dp * pp * tp = 3 * 1 * 1 = 3 but the world size is 4"),
    (["--nproc", "3", "--dp", "2"], "world size is 3"),
    (["--n-head", "3"], "--n-head 3 does not divide --d-model 128"),
    (["--seq-len", "512"], "--seq-len 512 exceeds --max-seq-len 256"),
    (["--data", "/no/such/file.txt"], "--data '/no/such/file.txt' does not exist"),
    (["--global-batch", "10"], "--global-batch 10 is not divisible by --micro-batch * dp = 8 * 2"),
    (["--microbatches", "3"], "--microbatches 3 disagrees with --global-batch 16"),
    (
        ["--tp", "2", "--n-head", "3", "--d-model", "96"],
        "tensor parallel tp=2 must divide: 3 attention heads",
    ),
    (["--sequence-parallel"], "--sequence-parallel needs tensor parallelism"),
    (["--pp", "2", "--schedule", "pipedream"], "--schedule 'pipedream'; valid: gpipe, 1f1b"),
    (["--pp", "2", "--chunks", "2", "--n-layer", "3"], "--pp 2 x --chunks 2 = 4 pipeline pieces"),
    (
        [
            "--pp",
            "2",
            "--schedule",
            "interleaved",
            "--chunks",
            "2",
            "--global-batch",
            "8",
            "--micro-batch",
            "8",
        ],
        "interleaved",
    ),
    (["--chunks", "2"], "--chunks 2 needs a pipeline"),
    (["--trace"], "--trace draws the pipeline schedule: use --pp 2 or more"),
    (["--dp-mode", "async", "--nproc", "1"], "--dp-mode async needs pp = tp = 1 and dp >= 2"),
    (["--straggler", "5:3"], "--straggler '5:3': rank must be in 0..1"),
    (["--comm-algo", "star"], "--comm-algo 'star'; valid: native, ring, tree"),
    (["--lr-scaling", "cubic"], "--lr-scaling 'cubic'; valid: none, linear, sqrt"),
    (["--bucket-mb", "-1"], "--bucket-mb -1.0 must be 0 or more"),
    (["--dp-mode", "hogwild"], "--dp-mode 'hogwild'; valid: sync, async"),
    (["--dc-lambda", "-0.5"], "--dc-lambda -0.5 must be 0 or more"),
    (["--zero", "5"], "--zero 5; valid: 0, 1, 2, 3"),
    (["--zero2-accumulate", "lazy"], "--zero2-accumulate 'lazy'; valid: full, shard"),
    (["--zero", "3", "--pp", "2"], "--zero 3 with a pipeline (--pp > 1) is refused"),
    (["--dtype", "float16", "--pp", "2"], "--dtype float16 with --pp 2 --dp-mode sync: fp16"),
    (["--dtype", "float8"], "--dtype 'float8'; valid: auto, float32"),
    (["--backend", "mpi"], "--backend 'mpi'; valid: auto, gloo, nccl"),
    (["--lr", "nan"], "--lr nan must be a finite number"),
    (["--lr", "inf"], "--lr inf must be a finite number"),
    (["--grad-clip=-inf"], "--grad-clip -inf must be a finite number"),
    (["--dropout", "nan"], "--dropout nan must be a finite number"),
    (["--comm-timeout-s", "nan"], "--comm-timeout-s nan must be a finite number"),
    (["--model", "gpt5"], "--model 'gpt5'; valid: gpt-tiny, gpt2-124m, llama-tiny"),
    (["--n-kv-head", "2"], "--n-kv-head 2 applies to --arch llama only; this model is gpt"),
    (["--model", "llama-tiny", "--dropout", "0.1"], "--dropout 0.1 applies to --arch gpt"),
    (["--model", "llama-tiny", "--n-kv-head", "3"], "--n-kv-head 3 does not divide"),
    (["--model", "llama-tiny", "--tp", "4", "--nproc", "4"], "tp=4 must divide: 2 key/value"),
    (["--device", "tpu"], "--device 'tpu'; valid: auto, cpu, cuda"),
    (["--device", "cuda"], "--device cuda: this machine has no CUDA device; use --device cpu"),
    (["--backend", "nccl"], "--backend nccl with --device cpu: tensors on cpu travel over gloo"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--nproc", "0"], "--nproc 0 must be at least 1"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUTS)
def test_bad_flags_are_refused_in_one_line(capsys, flags, message):
    try:
        code, err = run_cli(capsys, "train", *flags)
    except SystemExit as e:  # argparse's own errors exit directly
        code, err = e.code, capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[train]\nstepz = 5\n", "unknown key train.stepz; valid keys: steps,"),
        ("[trian]\nsteps = 5\n", "unknown section [trian]; valid: model, parallel, train, data"),
        ('[train]\nsteps = "five"\n', "train.steps = 'five' has type str; expected int"),
        ("[model]\ndropout = true\n", "model.dropout = True has type bool; expected float"),
        ("[train\nsteps = 5\n", "is not valid TOML"),
    ],
)
def test_bad_config_files_are_refused_in_one_line(capsys, tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    code, err = run_cli(capsys, "train", "--config", str(path))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_missing_config_file(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "--config", str(tmp_path / "nope.toml"))
    assert code == 2 and "does not exist" in err


def test_existing_run_directory_is_never_overwritten(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    code, err = run_cli(capsys, "train", "--out", str(out))
    assert code == 2 and "already exists and is not empty" in err
    assert (out / "metrics.jsonl").read_text() == "precious\n"


def test_console_script_exits_2_without_traceback():
    """The installed entry point, as a user runs it (one process start, ~3 s)."""
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", "--nproc", "4", "--dp", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "paratrain train: error: dp * pp * tp = 3 * 1 * 1 = 3 but the world size is 4; "
        "choose degrees whose product is 4"
    )


def _data_cases(tmp_path):
    import numpy as np

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    big_ids = tmp_path / "ids.bin"
    np.array([1, 2, 300, 5] * 1000, dtype=np.uint16).tofile(big_ids)
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    no_text = tmp_path / "images"
    no_text.mkdir()
    (no_text / "a.png").write_bytes(b"\x89PNG")
    return [
        (empty, f"--data '{empty}' is empty"),
        (odd, f"--data '{odd}' has 3 bytes, not a whole number of uint16 ids"),
        (big_ids, "has token ids up to 300, the model's vocabulary is 256; use --vocab-size 301"),
        (short, "fewer than one sequence of seq_len + 1 = 129"),
        (no_text, "holds no text files"),
    ]


def test_bad_data_is_refused_before_any_worker_and_leaves_nothing(tmp_path, capsys):
    for data, message in _data_cases(tmp_path):
        out = tmp_path / f"run-{data.name}"
        code, err = run_cli(capsys, "train", "--data", str(data), "--out", str(out))
        assert code == 2, (data, err)
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()  # no run directory for a failed start


def test_dry_run_prints_the_run_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--dry-run", "--nproc", "4", "--pp", "2", "--tp", "2", "--out", str(out)]
    assert main([*argv, "--global-batch", "16", "--micro-batch", "4"]) == 0
    printed = capsys.readouterr().out
    for section in ("# resolved configuration", "# mesh: dp=1 pp=2 tp=2", "# data: ", "# plan"):
        assert section in printed
    assert "rank 3: pp 1, dp 0, tp 1: blocks 2-3; model state" in printed
    assert not out.exists()
    # the same checks as a real start: the same refusal, the same line
    code, err = run_cli(capsys, "train", "--dry-run", "--lr", "nan")
    assert code == 2 and "--lr nan must be a finite number" in err


# Each conditional field of config.EFFECTS: (its flag and a value other than the default,
# a configuration where it has no effect, one where it has).
LLAMA = ["--model", "llama-tiny"]
ASYNC = ["--dp-mode", "async"]
MOE = ["--num-experts", "4"]
HSDP = ["--replicas", "2", "--zero", "1"]  # 2 replica groups of one rank
DILOCO = ["--dp-mode", "diloco", "--replicas", "2"]
INEFFECTIVE = {
    "model.n_kv_head": (["--n-kv-head", "1"], [], LLAMA),
    "model.ffn_hidden": (["--ffn-hidden", "96"], [], LLAMA),
    "model.rope_theta": (["--rope-theta", "500000"], [], LLAMA),
    "model.norm_eps": (["--norm-eps", "1e-6"], [], LLAMA),
    "model.dropout": (["--dropout", "0.1"], LLAMA, []),
    "model.activation": (["--activation", "gelu_tanh"], LLAMA, []),
    "model.top_k": (["--top-k", "1"], [], MOE),
    "model.capacity_factor": (["--capacity-factor", "1.25"], [], MOE),
    "model.aux_loss_coef": (["--aux-loss-coef", "0.1"], [], MOE),
    "model.bias_rate": (["--bias-rate", "0.001"], [], MOE),
    "model.shared_expert": (["--shared-expert"], [], MOE),
    "parallel.prefetch": (["--prefetch", "2"], [], ["--zero", "3"]),
    "train.muon_momentum": (["--muon-momentum", "0.9"], [], ["--optimizer", "muon"]),
    "train.lora_alpha": (["--lora-alpha", "8"], [], ["--lora-rank", "4"]),
    "train.lora_targets": (["--lora-targets", "blocks.*.attn.q"], [], ["--lora-rank", "4"]),
    "train.muon_nesterov": (["--no-muon-nesterov"], [], ["--optimizer", "muon"]),
    "train.muon_ns_steps": (["--muon-ns-steps", "3"], [], ["--optimizer", "muon"]),
    "train.muon_lr_adjust": (["--muon-lr-adjust", "original"], [], ["--optimizer", "muon"]),
    "train.muon_ns_dtype": (["--muon-ns-dtype", "float32"], [], ["--optimizer", "muon"]),
    "parallel.replicas": (["--replicas", "2"], [], ["--zero", "1"]),
    "parallel.zero2_accumulate": (
        ["--zero2-accumulate", "full"], ["--zero", "2"], ["--zero", "2", "--global-batch", "32"]
    ),
    "parallel.schedule": (["--schedule", "gpipe"], [], ["--pp", "2"]),
    "parallel.chunks": (["--chunks", "2"], [], ["--pp", "2", "--schedule", "interleaved"]),
    "parallel.sequence_parallel": (["--sequence-parallel"], [], ["--tp", "2"]),
    "parallel.cp_method": (["--cp-method", "alltoall"], [], ["--cp", "2"]),
    "parallel.comm_timeout_s": (["--comm-timeout-s", "60"], ["--nproc", "1"], []),
    "parallel.comm_algo": (["--comm-algo", "ring"], ["--nproc", "1"], []),
    "parallel.comm_order": (["--comm-order", "nccl"], ["--nproc", "1"], []),
    "parallel.bucket_mb": (["--bucket-mb", "10"], ["--zero", "3"], ["--zero", "2"]),
    "parallel.dc_lambda": (["--dc-lambda", "0.5"], [], ASYNC),
    "parallel.compress": (["--compress", "int8"], ["--nproc", "1"], []),
    "parallel.compress_rank": (
        ["--compress-rank", "2"], ["--compress", "int8"], ["--compress", "powersgd"]
    ),
    "parallel.compress_start": (["--compress-start", "2"], [], ["--compress", "sign"]),
    "train.beta1": (["--beta1", "0.8"], ["--optimizer", "sgd"], []),
    "train.beta2": (["--beta2", "0.9"], ["--optimizer", "sgd"], []),
    "parallel.sync_every": (["--sync-every", "10"], [], DILOCO),
    "parallel.fragments": (["--fragments", "2"], [], [*DILOCO, "--checkpoint-every", "0"]),
    "parallel.outer_lr": (["--outer-lr", "1.0"], [], DILOCO),
    "parallel.outer_dtype": (["--outer-dtype", "int8"], [], DILOCO),
    "parallel.sync_delay": (["--sync-delay", "1"], [], [*DILOCO, "--checkpoint-every", "0"]),
    "parallel.merge_alpha": (["--merge-alpha", "0.5"], [], [*DILOCO, "--checkpoint-every", "0"]),
    "parallel.outer_momentum": (["--outer-momentum", "0.5"], [], DILOCO),
    "parallel.outer_nesterov": (["--no-outer-nesterov"], [], DILOCO),
    "parallel.staleness_bound": (["--staleness-bound", "2"], [], ASYNC),
    "parallel.dc_mode": (["--dc-mode", "adaptive"], ASYNC, [*ASYNC, "--dc-lambda", "0.5"]),
    "parallel.dc_decay": (["--dc-decay", "0.5"], [*ASYNC, "--dc-lambda", "0.5"],
                          [*ASYNC, "--dc-lambda", "0.5", "--dc-mode", "adaptive"]),
    "parallel.max_restarts": (["--max-restarts", "1"], ["--nproc", "1"], []),
    "parallel.fault_tolerance": (["--fault-tolerance"], [], HSDP),
    "parallel.min_replicas": (["--min-replicas", "1"], HSDP, [*HSDP, "--fault-tolerance"]),
    "parallel.heartbeat_timeout_s": (
        ["--heartbeat-timeout-s", "2"], HSDP, [*HSDP, "--fault-tolerance"]
    ),
    "parallel.inject_fault": (["--inject-fault", "kill:1:2"], HSDP, [*HSDP, "--fault-tolerance"]),
    "parallel.ft_data": (["--ft-data", "replay"], HSDP, [*HSDP, "--fault-tolerance"]),
    "parallel.coordinator": (
        ["--coordinator", "127.0.0.1:0"], HSDP, [*HSDP, "--fault-tolerance"]
    ),
    "train.lr_base_batch": (["--lr-base-batch", "32"], [], ["--lr-scaling", "linear"]),
    "train.loss_scale": (["--loss-scale", "1024"], [], ["--dtype", "float16"]),
    "train.trace": (["--trace"], [], ["--pp", "2"]),
    "train.max_skipped_steps": (["--max-skipped-steps", "5"], ASYNC, []),
    "train.rewarmup_steps": (
        ["--rewarmup-steps", "5"], [*ASYNC, "--max-restarts", "1"], ["--max-restarts", "1"]
    ),
}  # fmt: skip
NEEDS_FILES = {  # tested below with files of their own
    "data.val_fraction": "a prepared directory",
    "parallel.replay_quorum": "a quorum record (tests/test_fault_tolerance.py)",
    "parallel.ft_group": "torchrun, and refused without it (tests/test_fault_tolerance.py)",
}


def test_every_field_says_when_it_has_an_effect():
    fields = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(EFFECTS) == fields  # a new field must say when it matters
    conditional = {key for key, effect in EFFECTS.items() if effect is not None}
    assert conditional == set(INEFFECTIVE) | set(NEEDS_FILES)


def _dry_run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(["train", "--dry-run", *argv])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("key", sorted(INEFFECTIVE))
def test_a_flag_without_effect_is_refused_and_with_its_setting_accepted(key, capsys):
    flag, off, on = INEFFECTIVE[key]
    code, err = _dry_run([*off, *flag], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert flag[0] in err or key.split(".")[1] in err, err  # names the flag
    code, err = _dry_run([*on, *flag], capsys)
    assert code == 0, err


def test_comm_order_nccl_is_refused_with_cuda(capsys, monkeypatch):
    """On cuda the backend is NCCL, which orders its calls itself: the flag has no effect.
    No GPU here: the check is reached as on a machine with two."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, err = _dry_run(["--device", "cuda", "--comm-order", "nccl"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.endswith(
        "--comm-order nccl has no effect here: it needs more than one process on gloo "
        "(--device cpu)"
    ), err


def test_a_default_given_explicitly_is_never_refused(capsys):
    assert (
        _dry_run(["--prefetch", "1", "--loss-scale", "65536", "--schedule", "1f1b"], capsys)[0] == 0
    )
    assert _dry_run(["--zero2-accumulate", "shard"], capsys)[0] == 0  # ZeRO-2's default


def test_a_config_file_key_without_effect_is_refused_naming_the_file(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\nprefetch = 4\n")
    code, err = _dry_run(["--config", str(path)], capsys)
    assert code == 2
    assert err.endswith(f"parallel.prefetch = 4 in {path} has no effect here: it needs --zero 3")


def test_checkpoints_resume_and_recompute_are_accepted_in_async(tmp_path, capsys):
    """They work in both modes now (tests/test_async_checkpoint.py): --resume of a run
    without checkpoints is refused for that, not for the mode."""
    flags = ["--recompute", "full", "--checkpoint-every", "5", "--keep-checkpoints", "1"]
    code, err = _dry_run([*ASYNC, *flags], capsys)
    assert code == 0, err
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(RunConfig()))
    code, err = _dry_run(["--resume", str(run), *ASYNC], capsys)
    assert code == 2 and err.endswith("no complete checkpoint in its checkpoints/"), err


def test_a_prepared_directorys_split_is_refused_where_it_does_nothing(tmp_path):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "meta.json").write_text("{}")
    assert EFFECTS["data.val_fraction"].applies(RunConfig())
    cfg = RunConfig()
    cfg.data.path = str(prepared)
    assert not EFFECTS["data.val_fraction"].applies(cfg)
