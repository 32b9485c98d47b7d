"""One rank of a cluster run, simulated on this machine: built exactly as `paratrain train`
builds it (train/build.py, the Mesh, the engine, `train_step`), on fake tensors (shapes,
dtypes and devices, no memory) over torch's fake process group (every collective returns
at once, at any world size), and measured against the planner.

- `fake.py`: the fake world (backend, process group) and the fake tensors, in one place;
- `rank.py`: one rank's build and steps, and what it measured (state bytes, the ledger's
  bytes and calls per group, FLOPs);
- `compare.py`: the planner's prediction for the same rank, under the same keys;
- `ranks.py`: which ranks to simulate (`--ranks`), each in its own process.

May import: `config`, `comm`, `mesh`, `models`, `parallel`, `plan`, `train`, `data`;
never `validate`, `bench` or a command (the command checks its input before any process
starts, as `train` does).
"""
