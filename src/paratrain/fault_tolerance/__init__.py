"""Per-step fault tolerance across HSDP's replica groups (docs/reliability.md).

Each replica group is its own job: its own elastic agent, its own torch.distributed world,
ZeRO within it. A coordinator, which the launcher runs (coordinator.py), holds a TCPStore
that every group reaches. Every step is a round:

1. ask: the group's leader says it is ready for a round, with the step it is at;
2. quorum: the coordinator waits for every group whose heartbeat is fresh, then names the
   round's participants (at least `--min-replicas`, never a group alone), the step, each
   one's slice of the sample stream, the generation of the cross-group process groups
   (new when the members change or a round failed) and, for a group behind the others
   (relaunched), the peer it copies from;
3. compute: each participant computes its gradient within the group, heals a member
   that is behind (a broadcast of the whole training state from the peer), and sums
   the gradients over the participants (across_groups.py). A group that can tell the
   round (the last one, a step on) computes it while the coordinator decides and checks
   the decision after its backward (rounds.py);
4. vote and commit: each participant says whether its reduction succeeded; the
   coordinator commits the round only when every participant did, and only then does
   any group update. A failed round changes nothing (the step is computed again).

The coordinator writes RUN_DIR/quorum.jsonl, a line per round; `--replay-quorum` trains
its committed rounds again with the same participants and samples, without failures, and
must end bitwise equal.
"""
