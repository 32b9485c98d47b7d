"""--dp-mode diloco --fault-tolerance (fault_tolerance/outer_rounds.py): a group killed in
the middle of an inner loop is left out, the others commit the next outer steps without
it, an aborted outer round changes nothing, a relaunched group heals from a live peer,
global parameters and outer momentum included, and every group's global state ends
bitwise the same; the run equals the replay of its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_fault_tolerance import FT, THREE_GROUPS, rounds, run

DILOCO = ["--dp-mode", "diloco", "--sync-every", "4", "--checkpoint-every", "0"]
STEPS = 16

pytestmark = pytest.mark.timeout(900)


def summaries(out: Path, key: str) -> dict[int, str]:
    """Each group's `key` digest, for the groups that trained to the last step."""
    found = [json.loads(p.read_text()) for p in out.glob("groups/*/summary.json")]
    return {s["group"]: s[key] for s in found if s["last_step"] == STEPS}


@pytest.mark.e2e
def test_a_group_killed_mid_inner_loop_is_left_out_and_an_aborted_outer_round_changes_nothing(
    tmp_path,
):
    """3 groups of one rank, H 4, 16 steps: group 1 is killed at step 6 and not relaunched.
    That round aborts; every later round, the outer ones of steps 8, 12 and 16 included,
    commits over groups 0 and 2 only, their pseudo-gradients' mean. The outer round of
    step 12 fails once (group 2's injected error: each group puts back the state it kept
    before its inner update) and is computed again. Groups 0 and 2 end with bitwise the
    same global parameters and momentum, and the fault-free replay of the record ends with
    each group's whole state bitwise the faulty run's (putting back nothing fails it)."""
    layout = [*THREE_GROUPS, *DILOCO, *FT, "--min-replicas", "1"]
    out = tmp_path / "faults"
    run(out, *layout, "--inject-fault", "kill:1:6", "--inject-fault", "allreduce-error:2:12",
        steps=STEPS)  # fmt: skip
    record = rounds(out)
    failed = [r["step"] for r in record if not r["committed"]]
    assert failed[0] == 5 and 11 in failed  # the kill; the outer round of step 12's error
    later = [r for r in record if r["committed"] and r["step"] >= 5]
    assert {tuple(r["participants"]) for r in later} == {(0, 2)}
    assert {r["step"] + 1 for r in later} >= {8, 12, 16}
    final = summaries(out, "global_digest")
    assert set(final) == {0, 2} and len(set(final.values())) == 1

    replay = tmp_path / "replay"
    run(replay, *layout, "--replay-quorum", str(out / "quorum.jsonl"), steps=STEPS)
    assert summaries(replay, "state_digest") == summaries(out, "state_digest")


@pytest.mark.e2e
def test_a_relaunched_group_heals_the_global_parameters_and_momentum(tmp_path):
    """2 groups of 2 ranks (ZeRO-1 within each), H 4: group 1 is killed at step 6 (after an
    outer step moved the global state from its start) and relaunched; the survivor never
    commits alone, so it waits, and group 1 copies its whole state (a heal in the
    record), the global parameters and outer momentum included: both groups end with
    bitwise the same global state (a heal without them fails this: the relaunched
    group's global copy would be its initial one)."""
    layout = ["--nproc", "4", "--replicas", "2", "--zero", "1", "--global-batch", "8"]
    out = tmp_path / "healed"
    args = [*layout, *DILOCO, *FT, "--max-restarts", "1", "--inject-fault", "kill:1:6"]
    run(out, *args, steps=STEPS)
    record = rounds(out)
    assert [1, 0] in [pair for r in record for pair in r["heal"]]
    final = summaries(out, "global_digest")
    assert set(final) == {0, 1} and len(set(final.values())) == 1


def test_streaming_or_quantized_diloco_under_fault_tolerance_is_refused(capsys):
    from tests.test_cli_main import refused

    base = ["train", "--nproc", "2", "--replicas", "2", "--dp-mode", "diloco", "--fault-tolerance"]
    for flag in (["--fragments", "2"], ["--outer-dtype", "int8"], ["--sync-delay", "1"],
                 ["--inject-fault", "hang:1:3"]):  # fmt: skip
        assert "not supported yet" in refused(capsys, *base, "--checkpoint-every", "0", *flag)
