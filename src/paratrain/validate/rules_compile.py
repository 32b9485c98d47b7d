"""Rules on --compile: what it cannot do, and inductor's C++ compiler; each failure is one
line naming the flag and what would be valid (docs/compile.md, "Refused")."""

from __future__ import annotations

from paratrain.config import RunConfig


def compile_rules(cfg: RunConfig) -> None:
    p, t = cfg.parallel, cfg.train
    if not t.compile:
        return
    if p.dp_mode == "async":
        raise ValueError(
            "--compile with --dp-mode async: the parameter server's workers are not compiled; "
            "use --dp-mode sync or drop --compile"
        )
    if t.recompute == "selective":
        raise ValueError(
            "--compile with --recompute selective: dynamo cannot trace the selective policy's "
            "replayable cache; use --recompute full or none"
        )
    if p.cp > 1:
        raise ValueError(
            f"--compile with --cp {p.cp}: ring and all-to-all attention talk inside the "
            "block, and no test yet shows them compiled; use --cp 1 or drop --compile"
        )
    if p.pp > 1 and p.schedule == "zb-h1":
        raise ValueError(
            "--compile with --schedule zb-h1: a compiled block is one autograd node whose "
            "backward computes input and weight gradients together, so there is no weight "
            "pass to defer; use gpipe, 1f1b or interleaved"
        )
    if p.device == "cpu":
        from paratrain.parallel.compile import cpp_compilers, find_cpp_compiler

        names = cpp_compilers()
        if find_cpp_compiler(names) is None:
            raise ValueError(
                f"--compile on the CPU needs a C++ compiler for inductor: none of "
                f"{', '.join(names)} is on PATH (install g++ or set CXX)"
            )
