"""Regional compilation: each transformer block compiled on its own with torch.compile
(inductor), as torchtitan does, rather than the whole model as one graph.

Why per block: the blocks are identical, so inductor's cache builds their kernels once and
compile time barely grows with depth (dynamo still captures each block, so each has its
own count), and everything between blocks (embeddings, the loss, the pipeline runtime,
data-parallel hooks) stays eager Python.

Where it goes in the build order (train/build.py): after tensor parallelism, so a block's
graphs hold its tensor-parallel layers; before recomputation, the pipeline split and the
data-parallel wrapper. Recomputation wraps the compiled forward (its checkpoint saves the
compiled graphs' tensors and runs them again in backward) rather than being captured
inside the graph: a checkpoint region that meets a graph break is not compiled at all,
and tensor parallelism's seams are breaks (measured: 0 graphs per block with --tp 2
--recompute full in the other order). Data parallelism's machinery sits outside every
block's forward: bucket and ZeRO hooks fire on parameters' gradient accumulation, FSDP
gathers a unit in the block's own forward pre-hook, which `Module.__call__` runs before
the compiled forward. The forward is replaced on the instance (as recomputation does), so
the block stays the same module: parameter names and the state dict are unchanged (no
`_orig_mod.`).

Tensor-parallel seams break the graph, by design. `comm/regions.py`'s f, g, gathers and
scatters, and the dropout RNG tracker's hooks, are disabled (`compat.graph_break`): every
collective goes through `paratrain.comm`, whose ledger reads clocks, takes locks and keeps
async work handles; traced, dynamo guards on the clock readings and recompiles at every
call until it gives up (measured: 55 graphs for a 2-block model). So each seam runs eagerly
between compiled graphs, counted by the ledger as always, and a tensor-parallel block
compiles into several graphs. Breaks at seams are reported apart from any other break.

What is compiled is counted, not assumed: each block gets its own backend (inductor's
`compile_fx` behind a counter), so each block's graphs are its own; dynamo's counters give
the graph breaks by reason and the frames it could not compile (eager fallbacks).
`fallback_random`: dropout inside a compiled graph draws from the same generator as the
uncompiled model, so compiled training equals eager training.
"""

from __future__ import annotations

import functools
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paratrain.comm import compat

INDUCTOR_OPTIONS = {"fallback_random": True}


def cpp_compilers() -> tuple[str, ...]:
    """The C++ compilers inductor tries on the CPU, in its order (its config reads $CXX)."""
    return tuple(c for c in compat.inductor_config().cpp.cxx if c)


def find_cpp_compiler(candidates: Sequence[str]) -> str | None:
    """The first of `candidates` found on PATH, or None."""
    return next((c for c in candidates if shutil.which(c)), None)


@dataclass
class BlockCompile:
    """One block's compilation: its backend counts graphs, its forward times compiling."""

    name: str
    graphs: int = 0  # graphs inductor compiled for this block (per grad mode, shape, piece)
    seconds: float = 0.0  # wall time of this block's forwards that compiled something

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        # As many compile workers as the rank has threads (its share of the cores): with
        # one, inductor compiles in the rank's own process and starts no worker pool,
        # which on 2 cores cost 25 s of the first compile (measured).
        options = {**INDUCTOR_OPTIONS, "compile_threads": torch.get_num_threads()}
        compiled: Callable[..., Any] = compat.inductor_compile_fx()(
            gm, example_inputs, config_patches=options
        )
        return compiled

    def timed(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(compiled)
        def forward(*args: Any, **kwargs: Any) -> Any:
            before, start = self.graphs, time.perf_counter()
            out = compiled(*args, **kwargs)
            if self.graphs != before:  # this call compiled (dynamo, then inductor)
                self.seconds += time.perf_counter() - start
            return out

        forward.compiled = True  # type: ignore[attr-defined]  # a mark on the function
        return forward


@dataclass
class CompileReport:
    """What compilation did on this rank, for the log line, metrics and the summary."""

    graphs: dict[str, int]  # block name -> graphs compiled for it
    seam_breaks: int  # graph breaks at our tensor-parallel seams (by design)
    other_breaks: dict[str, int]  # any other break, by dynamo's reason (first line)
    fallbacks: int  # frames dynamo could not compile: they ran eagerly
    seconds: float

    def line(self) -> str:
        per = sorted(set(self.graphs.values()))
        others = sum(self.other_breaks.values())
        return (
            f"compiled {len(self.graphs)} blocks: {'/'.join(map(str, per))} graphs each, "
            f"{self.seam_breaks} breaks at comm seams, {others} other breaks, "
            f"{self.fallbacks} eager fallbacks, {self.seconds:.1f} s compiling"
        )

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _dynamo_counts() -> tuple[Counter[str], int]:
    counters = compat.dynamo_counters()
    breaks = Counter({reason: n for reason, n in counters["graph_break"].items()})
    frames = counters["frames"]
    fallbacks: int = frames["total"] - frames["ok"]
    return breaks, fallbacks


@dataclass
class CompiledBlocks:
    """The blocks one `compile_blocks` call compiled; counters are taken from that call on
    (dynamo's are per process, and a process may train several runs)."""

    blocks: list[tuple[nn.Module, BlockCompile]]
    _breaks_at_start: Counter[str] = field(default_factory=Counter)
    _fallbacks_at_start: int = 0

    @property
    def seconds(self) -> float:
        return sum(b.seconds for _, b in self.blocks)

    def only(self, modules: Sequence[nn.Module]) -> CompiledBlocks:
        """The blocks among `modules` and their descendants (this pipeline stage's)."""
        here = {id(m) for top in modules for m in top.modules()}
        kept = [(m, b) for m, b in self.blocks if id(m) in here]
        return CompiledBlocks(kept, self._breaks_at_start, self._fallbacks_at_start)

    def report(self) -> CompileReport:
        breaks, fallbacks = _dynamo_counts()
        breaks.subtract(self._breaks_at_start)
        seam = sum(n for r, n in breaks.items() if compat.SEAM_BREAK in r)
        other = {
            r.splitlines()[0]: n for r, n in breaks.items() if n > 0 and compat.SEAM_BREAK not in r
        }
        return CompileReport(
            graphs={b.name: b.graphs for _, b in self.blocks},
            seam_breaks=seam,
            other_breaks=other,
            fallbacks=fallbacks - self._fallbacks_at_start,
            seconds=self.seconds,
        )


ENTRIES_PER_BLOCK = 8  # dynamo's own default limit, per block


def compile_blocks(blocks: Sequence[tuple[str, nn.Module]]) -> CompiledBlocks:
    """Compile each (name, block)'s forward on the instance; compilation itself happens at
    each block's first forward."""
    breaks, fallbacks = _dynamo_counts()
    # Every block's forward is the same code object, and each block's own backend gives
    # it its own cache entries there (train and eval, recomputation: a few each). Past
    # dynamo's limit of 8 entries per code object the rest run eager: a 12-block model
    # compiled 0 graphs for some blocks. The limits grow by room for these blocks.
    room = ENTRIES_PER_BLOCK * len(blocks)
    dynamo_config = compat.dynamo_config()
    dynamo_config.recompile_limit += room
    dynamo_config.accumulated_recompile_limit += room
    done = []
    for name, block in blocks:
        record = BlockCompile(name)
        block.forward = record.timed(torch.compile(block.forward, backend=record.backend))
        done.append((block, record))
    return CompiledBlocks(done, breaks, fallbacks)
