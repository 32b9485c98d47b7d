"""The GPU check's equivalence part (scripts/gpu-check.sh runs it): on a device, paratrain's
training equals plain PyTorch's on the same device.

    PYTHONPATH=src:. python scripts/gpu_check.py equivalence [--device cuda|cpu]
        [--world 1|2|8] [--layouts dp,zero1,...]

Worlds (default on CUDA: 1, then 2 with two or more GPUs, then 8 with eight; on the CPU: 2):
- 1: each data-parallel wrapper (DataParallel, ZeRO-1, ZeRO-2, FSDP) at dp = 1, in this
  process with no process group: the allocation and sharding paths, without collectives.
- 2: DataParallel, ZeRO-1, ZeRO-2, FSDP at dp = 2; tensor parallel with sequence
  parallelism at tp = 2; pipeline 1F1B at pp = 2. NCCL with one GPU per rank (gloo on the
  CPU), ranks started by the spawner the tests use (paratrain.spawn).
- 8: dp 2 x pp 2 x tp 2, 1F1B.

Every layout goes through `paratrain.train.loop.train`, what `paratrain train` runs, on
tests/equivalence.py's tiny GPT (4 layers, 4 heads: tests/test_composition.py's) for 4
steps in float32, set explicitly since CUDA's default is bf16, with clipping active; and is
compared with plain PyTorch on the same device (`device_reference`: tests/equivalence.py's
reference, its model and batches moved to the device), by the tests' tolerances. The
reference is the same for every layout, since it trains on the whole global batch at once.
One table row per layout, PASS or FAIL; a layout that crashes is a FAIL with its error
(after a failure in a set of ranks, each layout runs alone so the others still report);
exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for entry in (str(ROOT), str(ROOT / "src")):  # as PYTHONPATH=src:. would; kept if given
    if entry not in sys.path:
        sys.path.insert(0, entry)

import torch  # noqa: E402
from tests import equivalence as eq  # noqa: E402

from paratrain.config import RunConfig  # noqa: E402
from paratrain.data.tokens import TokenData  # noqa: E402
from paratrain.validate import resolve_and_check  # noqa: E402

CLIP = 0.5  # below the reference's gradient norms (about 1 to 3): every step clips


@dataclass(frozen=True)
class Layout:
    key: str  # for --layouts
    title: str
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    sequence_parallel: bool = False


LAYOUTS = {
    1: [
        Layout("dp", "DataParallel"),
        Layout("zero1", "ZeRO-1", zero=1),
        Layout("zero2", "ZeRO-2", zero=2),
        Layout("zero3", "FSDP (ZeRO-3)", zero=3),
    ],
    2: [
        Layout("dp", "DataParallel", dp=2),
        Layout("zero1", "ZeRO-1", dp=2, zero=1),
        Layout("zero2", "ZeRO-2", dp=2, zero=2),
        Layout("zero3", "FSDP (ZeRO-3)", dp=2, zero=3),
        Layout("tp-sp", "TP + sequence parallel", tp=2, sequence_parallel=True),
        Layout("pp-1f1b", "PP 1F1B", pp=2),
    ],
    8: [Layout("3d", "dp 2 x pp 2 x tp 2, 1F1B", dp=2, pp=2, tp=2)],
}


def layout_config(layout: Layout, world: int, device: str) -> RunConfig:
    """tests/test_composition.py's tiny GPT in `layout`, resolved; K = 2 to 4 micro-batches."""
    cfg = eq.tiny_config(micro_batch=4 if world == 1 else 2, grad_clip=CLIP)
    cfg.model.n_layer, cfg.model.n_head = 4, 4
    p = cfg.parallel
    p.nproc, p.device, p.dp, p.pp, p.tp = world, device, layout.dp, layout.pp, layout.tp
    p.zero, p.sequence_parallel = layout.zero, layout.sequence_parallel
    cfg.train.dtype = "float32"  # the reference's; CUDA's default would be bf16
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, world)


def full_float32() -> None:
    """Matrix products in float32 in full on CUDA, as on the CPU: no TF32, whatever a build
    or an image defaults to (tolerances of 2e-6 would not hold with its 10-bit mantissa)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def device_reference(
    cfg: RunConfig, data: TokenData, device: torch.device
) -> tuple[eq.RunRecord, dict]:
    """tests/equivalence.py's reference on `device`, in full float32."""
    full_float32()
    return eq.reference_training(cfg, data, device=str(device))


def train_on_rank(
    rank: int, world: int, configs: list[RunConfig], data: TokenData, device_type: str
) -> list[eq.RunRecord]:
    """On one rank (or in this process when world is 1): train every config in turn through
    `paratrain.train.loop.train`; this rank's records, parameters on the CPU."""
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    full_float32()
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    records = []
    for cfg in configs:
        p = cfg.parallel
        mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp, device=device)
        record = eq.record_of(train(cfg, mesh, data), mesh.group("tp"))
        mesh.close()
        state = {k: v.cpu() for k, v in record.state.items()}
        records.append(eq.RunRecord(record.losses, record.grad_norms, state))
    return records


@dataclass
class Outcome:
    layout: Layout
    world: int
    backend: str
    loss_rdiff: float  # the largest relative difference over the steps
    norm_rdiff: float
    param_diff: float  # the largest absolute difference over every parameter
    error: str  # the first failed check; "" when all pass
    tolerance: eq.Tolerance  # derived on this device from a float64 reference

    def within(self) -> bool:
        t = self.tolerance
        return (
            self.loss_rdiff <= t.loss_rtol
            and self.norm_rdiff <= t.norm_rtol
            and self.param_diff <= t.param_atol
        )

    def row(self) -> str:
        result = "PASS" if not self.error else f"FAIL: {self.error}"
        t = self.tolerance
        return (
            f"| {self.layout.title} | {self.world} | {self.backend} | "
            f"{self.loss_rdiff:.2g} (<= {t.loss_rtol:.2g}) | "
            f"{self.norm_rdiff:.2g} (<= {t.norm_rtol:.2g}) | "
            f"{self.param_diff:.2g} (<= {t.param_atol:.2g}) | {result} |"
        )


def _max_rdiff(values: list[float], reference: list[float]) -> float:
    pairs = zip(values, reference, strict=False)
    return max((abs(a - b) / abs(b) if b else abs(a) for a, b in pairs), default=math.inf)


def compare(
    layout: Layout,
    world: int,
    backend: str,
    records: list[eq.RunRecord],
    reference: tuple[eq.RunRecord, dict],
) -> Outcome:
    """Every rank's record of one layout against the reference (as the tests check it:
    tests/equivalence.py's `assert_equivalent` on the stages' parameters put together, the
    ranks' losses and norms identical, clipping active), with the largest differences."""
    ref, initial = reference
    state: dict[str, torch.Tensor] = {}
    for record in records:
        state.update(record.state)
    first = records[0]
    error = ""
    try:
        assert all(n > CLIP for n in ref.grad_norms), "clipping must be active"
        eq.assert_equivalent(eq.RunRecord(first.losses, first.grad_norms, state), ref, initial)
        for r in records:
            assert r.losses == first.losses and r.grad_norms == first.grad_norms, "ranks differ"
    except AssertionError as e:
        error = str(e).splitlines()[0]
    common = state.keys() & ref.state.keys()
    diffs = [(state[k].float() - ref.state[k].float()).abs().max().item() for k in common]
    return Outcome(
        layout,
        world,
        backend,
        _max_rdiff(first.losses, ref.losses),
        _max_rdiff(first.grad_norms, ref.grad_norms),
        max(diffs, default=math.inf),
        error,
        ref.tolerance,
    )


def train_world(
    world: int, configs: list[RunConfig], data: TokenData, device_type: str, backend: str
) -> list[list[eq.RunRecord] | str]:
    """Per config: every rank's record, or the error that stopped it. All configs in one
    set of ranks; after a failure, one set per config, to name the one that fails and still
    report the others."""
    from tests.distributed import RankFailed, run_distributed

    if world == 1:
        return [_in_process(cfg, data, device_type) for cfg in configs]
    try:
        per_rank = run_distributed(
            train_on_rank, world, configs, data, device_type, timeout=150, backend=backend
        )
    except (RankFailed, TimeoutError) as e:
        if len(configs) == 1:
            return [_last_line(e)]
        return [train_world(world, [c], data, device_type, backend)[0] for c in configs]
    return [[records[i] for records in per_rank] for i in range(len(configs))]


def _in_process(cfg: RunConfig, data: TokenData, device_type: str) -> list[eq.RunRecord] | str:
    try:
        return train_on_rank(0, 1, [cfg], data, device_type)
    except Exception as e:  # reported as the layout's FAIL; the other layouts go on
        return _last_line(e)


def _last_line(e: BaseException) -> str:
    """The exception's own line: a rank's traceback ends with it."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def check_world(world: int, device_type: str, keys: list[str] | None = None) -> list[Outcome]:
    """Train the world's layouts (those named in `keys`, default all) and compare each."""
    layouts = [x for x in LAYOUTS[world] if keys is None or x.key in keys]
    if not layouts:
        return []
    configs = [layout_config(x, world, device_type) for x in layouts]
    backend = "none" if world == 1 else configs[0].parallel.backend
    data = eq.tiny_data()
    trained = train_world(world, configs, data, device_type, backend)
    reference = device_reference(configs[0], data, torch.device(device_type, 0))
    outcomes = []
    for layout, result in zip(layouts, trained, strict=True):
        if isinstance(result, str):
            nan = math.nan
            outcomes.append(Outcome(layout, world, backend, nan, nan, nan, f"crashed: {result}"))
        else:
            outcomes.append(compare(layout, world, backend, result, reference))
    return outcomes


def default_worlds(device_type: str) -> list[int]:
    if device_type == "cpu":
        return [2]
    gpus = torch.cuda.device_count()
    return [1] + [w for w in (2, 8) if gpus >= w]


def skipped_lines(device_type: str, worlds: list[int]) -> list[str]:
    """One line per world of GPU layouts this machine has too few GPUs for."""
    if device_type != "cuda":
        return []
    gpus = torch.cuda.device_count()
    return [
        f"skipped for lack of GPUs (world {w} needs {w}, this machine has {gpus}): "
        + ", ".join(x.title for x in LAYOUTS[w])
        for w in sorted(LAYOUTS)
        if w not in worlds and w > gpus
    ]


def equivalence(args: argparse.Namespace) -> int:
    keys = args.layouts.split(",") if args.layouts else None
    known = {x.key for layouts in LAYOUTS.values() for x in layouts}
    if keys and not set(keys) <= known:
        raise SystemExit(f"--layouts {args.layouts}: valid keys {', '.join(sorted(known))}")
    worlds = [args.world] if args.world else default_worlds(args.device)
    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        where = "CPU"
    print(
        f"equivalence on {args.device} ({where}, torch {torch.__version__}): tiny GPT, 4 layers, "
        f"{eq.tiny_config().train.steps} steps, float32, against plain PyTorch on the device"
    )
    print(
        "| layout | world | backend | loss rel. diff | grad-norm rel. diff | param diff | result |"
    )
    print("|---|---|---|---|---|---|---|")
    outcomes = []
    for world in worlds:
        for outcome in check_world(world, args.device, keys):
            print(outcome.row(), flush=True)
            outcomes.append(outcome)
    failed = sum(bool(o.error) for o in outcomes)
    for line in skipped_lines(args.device, worlds):
        print(line)
    print(
        "tolerances (in brackets): loss and grad norm relative, parameters absolute, derived "
        "on this device from a float64 reference (tests/equivalence.py: Tolerance)"
    )
    print(f"equivalence: {len(outcomes) - failed} passed, {failed} failed", flush=True)
    return 1 if failed or not outcomes else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    eqv = sub.add_parser("equivalence", help="every layout against plain PyTorch on the device")
    eqv.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    eqv.add_argument("--world", type=int, choices=sorted(LAYOUTS), help="only this world size")
    eqv.add_argument("--layouts", default="", help="comma-separated keys (default: all)")
    args = parser.parse_args(argv)
    return equivalence(args)


if __name__ == "__main__":
    sys.exit(main())
