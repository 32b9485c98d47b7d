"""A batch that does not divide, or a schedule that cannot run this many micro-batches,
refused in the flags' words with a value that would work (validate.py calls these).

K, the micro-batches per step, is not a flag: it is --global-batch / (--micro-batch * dp).
So a refusal about K names G, b and dp, and the --micro-batch or --global-batch that
gives a K the schedule takes, found by trying the schedule's own check.
"""

from __future__ import annotations

import re

from paratrain.config import RunConfig


def indivisible_batch(global_batch: int, micro_batch: int, dp: int) -> str:
    """--global-batch G that micro-batch * dp does not divide: what would."""
    per_pass = micro_batch * dp
    fixes = [f"--global-batch {per_pass * max(1, round(global_batch / per_pass))}"]
    if global_batch % dp == 0:
        per_rank = global_batch // dp
        top = min(micro_batch - 1, per_rank)  # bounded: flags can be huge (2^63)
        b = next((d for d in range(top, max(0, top - 4096), -1) if per_rank % d == 0), 1)
        fixes.append(f"--micro-batch {b} (G / dp = {per_rank} per replica)")
    return (
        f"--global-batch {global_batch} is not divisible by --micro-batch * dp = "
        f"{micro_batch} * {dp} = {per_pass}; use {' or '.join(fixes)}"
    )


def _builds(cfg: RunConfig, microbatches: int) -> bool:
    from paratrain.parallel.pipeline import build_schedule

    p = cfg.parallel
    try:
        build_schedule(p.schedule, p.pp, microbatches, p.chunks)
    except ValueError:
        return False
    return True


def check_schedule_batch(cfg: RunConfig) -> None:
    """Build (and so check) the pipeline schedule for the resolved K; refuse in flags."""
    from paratrain.parallel.pipeline import build_schedule

    p, t = cfg.parallel, cfg.train
    dp = t.global_batch // (t.micro_batch * t.microbatches)  # the replicas K was resolved for
    try:
        build_schedule(p.schedule, p.pp, t.microbatches, p.chunks)
    except ValueError as e:
        why = _in_flags(str(e))
        flags = f"--schedule {p.schedule} --pp {p.pp}" + (
            f" --chunks {p.chunks}" if p.chunks > 1 else ""
        )
        if "K =" not in why:  # not about the batch: the schedule's own words, in flags
            raise ValueError(f"{flags}: {why}") from None
        raise ValueError(
            f"{flags}: K = --global-batch / (--micro-batch * dp) = {t.global_batch} / "
            f"({t.micro_batch} * {dp}) = {t.microbatches} micro-batches per step; {why}"
            + _fixes(cfg, dp)
        ) from None


TRAIN_WORDS = {"num_microbatches": "K", "num_stages": "--pp", "chunks": "--chunks"}


def _in_flags(message: str, words: dict[str, str] = TRAIN_WORDS) -> str:
    """The schedule's message (its own parameter names) in the command line's words:
    `num_stages=2` -> `--pp 2`, `num_microbatches=1` -> `K = 1` (no flag: G / (b dp))."""
    message = re.sub(r"^\w[\w-]*: ", "", message)  # "interleaved: " is said already
    for name, flag in words.items():
        sep = " = " if not flag.startswith("--") else " "
        message = re.sub(rf"\b{name}\s*=\s*(-?\d+)", rf"{flag}{sep}\1", message)
    return re.sub(r"schedule '([\w-]+)'", r"--schedule \1", message)


def schedule_in_flags(message: str) -> str:
    """`paratrain schedule`'s refusal, in its flags (--stages, --microbatches, --chunks)."""
    words = {"num_microbatches": "--microbatches", "num_stages": "--stages", "chunks": "--chunks"}
    return _in_flags(message, words)


MAX_K = 4096  # suggestions are searched among schedules of at most this many micro-batches


def _fixes(cfg: RunConfig, dp: int) -> str:
    """'; use --micro-batch b or --global-batch G' with the nearest values that build.
    Bounded: each try builds a schedule of K x stages actions, so only K <= MAX_K and a few
    dozen tries (a huge batch gets the schedule's reason alone)."""
    t, p, fixes = cfg.train, cfg.parallel, []
    per_rank = t.global_batch // dp
    for b in range(t.micro_batch - 1, max(0, t.micro_batch - 1 - MAX_K), -1):
        if per_rank // b > MAX_K:
            break
        if per_rank % b == 0 and _builds(cfg, per_rank // b):
            fixes.append(f"--micro-batch {b} (K = {per_rank // b})")
            break
    tries = max(64, 2 * p.pp * p.chunks)
    for k in range(t.microbatches + 1, min(t.microbatches + tries, MAX_K) + 1):
        if _builds(cfg, k):
            fixes.append(f"--global-batch {k * t.micro_batch * dp} (K = {k})")
            break
    return f"; use {' or '.join(fixes)}" if fixes else ""
