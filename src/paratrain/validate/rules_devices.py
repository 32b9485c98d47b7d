"""Rules on where ranks compute: the device exists, one GPU per rank, the backend that
carries its tensors, and the dtypes each combination supports."""

from __future__ import annotations

from paratrain.config import RunConfig


def device_rules(cfg: RunConfig, local_procs: int, count_gpus: bool = True) -> None:
    """local_procs: ranks on this node (torchrun's LOCAL_WORLD_SIZE, else --nproc).
    count_gpus False: cuda is only a candidate for `auto`, and counting would load torch."""
    p = cfg.parallel
    if p.device == "cuda" and count_gpus:
        _check_gpus(local_procs)
    wanted = "nccl" if p.device == "cuda" else "gloo"
    if p.backend != wanted:
        raise ValueError(
            f"--backend {p.backend} with --device {p.device}: tensors on {p.device} travel "
            f"over {wanted}; use --backend {wanted} or auto"
        )


def _check_gpus(local_procs: int) -> None:
    import torch  # only on cuda: a refusal on the CPU comes back without loading torch

    if not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device; use --device cpu")
    if local_procs > torch.cuda.device_count():
        raise ValueError(
            f"{local_procs} ranks on this node with --device cuda need {local_procs} GPUs (one "
            f"per rank); it has {torch.cuda.device_count()}"
        )


def dtype_rules(cfg: RunConfig) -> None:
    """Combinations named now so scripts can rely on them, refused until they land."""
    t, p = cfg.train, cfg.parallel
    if t.dtype == "float16" and (p.pp > 1 or p.dp_mode == "async"):
        raise ValueError(
            f"--dtype float16 with --pp {p.pp} --dp-mode {p.dp_mode}: fp16 loss scaling runs "
            "with pp = 1 and sync data parallelism (each pipeline chunk would scale again); "
            "use --dtype bfloat16, which needs no loss scale"
        )
