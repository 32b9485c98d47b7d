"""--dp-mode diloco --fault-tolerance (fault_tolerance/outer_rounds.py): a group killed in
the middle of an inner loop is left out, the others commit the next outer step without it,
the relaunched group heals from a live peer, global parameters and outer momentum
included, and every group's global state ends bitwise the same; the run equals the replay
of its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_fault_tolerance import FT, THREE_GROUPS, rounds, run

DILOCO = ["--dp-mode", "diloco", "--sync-every", "4", "--checkpoint-every", "0"]
STEPS = 40  # the killed group's relaunch (seconds) comes back within them, as a rule

pytestmark = pytest.mark.timeout(900)


def global_digests(out: Path) -> dict[int, str]:
    """Each group's digest of its global parameters and outer momentum, for the groups
    that trained to the last step."""
    summaries = [json.loads(p.read_text()) for p in out.glob("groups/*/summary.json")]
    return {s["group"]: s["global_digest"] for s in summaries if s["last_step"] == STEPS}


def state_digests(out: Path) -> dict[str, str]:
    """Each group's digest of its whole state (every group's own inner optimizer too)."""
    paths = out.glob("groups/*/summary.json")
    return {p.parent.name: json.loads(p.read_text())["state_digest"] for p in paths}


@pytest.mark.e2e
def test_a_group_killed_mid_inner_loop_is_left_out_of_the_outer_step_and_heals(tmp_path):
    """3 groups of one rank, H 4: group 1 is killed at step 6. That round aborts; the outer
    round of step 8 commits over groups 0 and 2 only (group 1 cannot be back two steps
    after its kill: its relaunch takes seconds). The outer round of step 12 fails once
    (group 2's injected error: every group puts back the state it kept before its inner
    update) and is computed again. When group 1 is back it copies a peer's state (a heal
    in the record), and at the end every group's global parameters and momentum are
    bitwise the same (a heal without the outer state fails this: its global copy would
    be the one it started from). The fault-free replay of the record ends with every
    group's whole state bitwise the faulty run's."""
    layout = [*THREE_GROUPS, *DILOCO, *FT, "--min-replicas", "1"]
    out = tmp_path / "faults"
    faults = ["--inject-fault", "kill:1:6", "--inject-fault", "allreduce-error:2:12"]
    run(out, *layout, "--max-restarts", "1", *faults, steps=STEPS)
    record = rounds(out)
    failed = [r["step"] for r in record if not r["committed"]]
    assert failed[0] == 5 and 11 in failed  # the kill; the outer round of step 12's error
    outer = next(r for r in record if r["committed"] and r["step"] == 7)  # done = 8
    assert outer["participants"] == [0, 2]
    healed = {pair[0] for r in record for pair in r["heal"]}
    final = global_digests(out)
    assert len(set(final.values())) == 1
    # Back at the last step only by a heal (it starts from nothing), and then in the same
    # state. (Under load it may come back too late, or be left out again and be behind
    # when the others end: the existing fault-tolerance tests say the same.)
    assert 1 not in final or 1 in healed

    replay = tmp_path / "replay"
    run(replay, *layout, "--replay-quorum", str(out / "quorum.jsonl"), steps=STEPS)
    assert global_digests(replay) == final
    whole, again = state_digests(out), state_digests(replay)
    assert {"0", "2"} <= whole.keys() & again.keys()
    assert all(whole[g] == again[g] for g in whole.keys() & again.keys())


def test_streaming_or_quantized_diloco_under_fault_tolerance_is_refused(capsys):
    from tests.test_cli_main import refused

    base = ["train", "--nproc", "2", "--replicas", "2", "--dp-mode", "diloco", "--fault-tolerance"]
    for flag in (["--fragments", "2"], ["--outer-dtype", "int8"], ["--sync-delay", "1"],
                 ["--inject-fault", "hang:1:3"]):  # fmt: skip
        assert "not supported yet" in refused(capsys, *base, "--checkpoint-every", "0", *flag)
