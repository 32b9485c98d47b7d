"""Fault tolerance with other layouts inside each replica group (tp, pp, cp, float16,
experts), and every group lost at once: a rewind to the checkpoint, then --resume on
another layout. Split from test_fault_tolerance.py (its helpers and conventions) so
that the two files' end-to-end runs share the test workers (`make test`: --dist loadfile).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.test_fault_tolerance import (
    FT,
    SMALL,
    STEPS,
    digests,
    logged,
    rounds,
    run,
)
from tests.test_reliability_cli import finish, refused, start

pytestmark = pytest.mark.timeout(900)


PAIRS_OF = ["--nproc", "4", "--replicas", "2", "--global-batch", "8"]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "inner",
    [
        ["--zero", "3", "--tp", "2"],
        ["--zero", "1", "--pp", "2"],
        ["--zero", "3", "--cp", "2"],
        ["--zero", "3", "--dtype", "float16", "--loss-scale", "256"],  # a healed group: its scaler
        # each group holds every expert; routing over the group's batch (no drops, no
        # balancing loss) is routing over the whole batch, as HSDP does
        ["--zero", "3", "--num-experts", "4", "--ep", "2", "--aux-loss-coef", "0"],
    ],
    ids=["tp2-zero3", "pp2-zero1", "cp2-zero3", "fp16-2ranks-zero3", "moe-ep2-zero3"],
)
def test_with_tensor_pipeline_or_context_parallel_groups_a_kill_changes_nothing(tmp_path, inner):
    """2 replica groups of tp 2, pp 2 or cp 2 ranks, or of 2 ranks in float16 (whose loss
    scaler, counting its good steps, the heal copies too); group 1 killed at step 4 and
    relaunched. A group alone never commits, so every committed step has both groups
    and the run must train as plain HSDP of that layout (proven equal to one process by
    test_hsdp), within test_without_faults_it_trains_as_hsdp's bound, with the relaunched
    group healed to the same state, rank by rank, as its peer."""
    steps, ft = 8, [*FT, "--min-replicas", "1", "--max-restarts", "1"]
    out = tmp_path / "ft"
    run(out, *PAIRS_OF, *inner, *ft, "--inject-fault", "kill:1:4", steps=steps)
    code, _, err = finish(start(*SMALL, "--steps", str(steps), *PAIRS_OF, *inner,
                                "--out", str(tmp_path / "hsdp"), cwd=tmp_path))  # fmt: skip
    assert code == 0, err
    assert any(not r["committed"] for r in rounds(out))  # the kill failed a round
    assert json.loads((out / "groups/1/summary.json").read_text())["restarts"] == 1
    assert len(digests(out, steps)) == 1
    for key in ("loss", "grad_norm"):
        ft_values, hsdp_values = logged(out, key), logged(tmp_path / "hsdp", key)
        assert len(ft_values) == steps
        assert ft_values == pytest.approx(hsdp_values, rel=1e-4), key


@pytest.mark.e2e
def test_every_group_lost_rewinds_to_the_checkpoint_and_resume_works_on_another_layout(
    tmp_path,
):
    """Both groups killed at step 8 (checkpoints every 3 steps) and relaunched: with no
    live peer each starts from the checkpoint of step 6, the record says `rewind`, and the
    run ends bitwise equal to the same run without faults and to the replay of its record.
    Then `--resume` of that run on another layout (2 groups of 2 ranks) trains its 2 more
    steps as a plain HSDP resume of it does, and the record goes on (rounds numbered on).

    The heartbeat timeout is one no relaunch here outlasts: both groups are back, their
    hearts beating, before the coordinator could see them silent, and each must not take
    the round its last incarnation asked for (decided, never voted) for its own."""
    every_3 = [*FT, "--heartbeat-timeout-s", "60", "--nproc", "2", "--replicas", "2",
               "--zero", "1", "--global-batch", "8", "--checkpoint-every", "3"]  # fmt: skip
    run(tmp_path / "plain", *every_3)
    out = tmp_path / "lost"
    run(out, *every_3, "--max-restarts", "1", "--inject-fault", "kill:0:8,kill:1:8")
    assert {"round": 8, "rewind": 6} in rounds(out)
    run(tmp_path / "replay", *every_3, "--replay-quorum", str(out / "quorum.jsonl"))
    assert digests(out) == digests(tmp_path / "plain") == digests(tmp_path / "replay")
    assert len(digests(out)) == 1

    hsdp = tmp_path / "hsdp"
    shutil.copytree(out, hsdp)
    for resumed, more in [(out, []), (hsdp, ["--no-fault-tolerance"])]:
        code, _, err = finish(start("--resume", str(resumed), "--steps", str(STEPS + 2),
                                    "--nproc", "4", *more, cwd=tmp_path))  # fmt: skip
        assert code == 0, err
    record = rounds(out)
    assert [r["step"] for r in record[-2:]] == [STEPS, STEPS + 1]
    assert record[-1]["round"] == max(r["round"] for r in record[:-1]) + 1
    for key in ("loss", "grad_norm"):
        assert logged(out, key)[STEPS:] == pytest.approx(logged(hsdp, key)[STEPS:], rel=1e-4)
    assert len(logged(out, "loss")) == STEPS + 2

    # What a resume cannot go on with is refused, before anything starts
    for args, words in [
        (["--ft-data", "replay"], "assigned samples by --ft-data drop"),
        (["--replicas", "1", "--nproc", "2", "--zero", "1"], "--replicas 2 or more"),
        (["--replay-quorum", str(out / "quorum.jsonl")], "drop --resume"),
    ]:
        line = refused("--resume", str(out), "--steps", str(STEPS + 4), *args, cwd=tmp_path)
        assert words in line, line
