"""The planner's gradient buckets (plan/grad_buckets.py) against the runtime's own
bucketing of the same model's parameters: the tensors in registration order, DataParallel's
buckets (last parameter first, the first bucket capped at 1 MiB) and ZeRO's flat buckets
(the buffer laid out last parameter first, as zero.py does; the padding in the last).
The simulation checks the same at tp > 1 and at scale through the calls and bytes it
compares (tests/test_simulate.py)."""

from __future__ import annotations

import pytest

from paratrain.parallel.data_parallel import buckets as runtime_buckets
from paratrain.parallel.data_parallel.flat_buffer import FlatLayout
from paratrain.parallel.data_parallel.flat_buffer import flat_buckets as runtime_flat_buckets
from paratrain.plan.grad_buckets import (
    DDP_FIRST_BUCKET_BYTES,
    chunk_tensors,
    ddp_bucket_sizes,
    flat_bucket_sizes,
)
from paratrain.plan.layout import ONE_BUCKET, PRECISIONS, Layout, Workload
from paratrain.plan.model import spec_of
from paratrain.train.build import build_model
from tests.equivalence import tiny_config

ARCHS = [("gpt", False), ("gpt", True), ("llama", False), ("llama", True)]
# bucket sizes that cut these models into one, a few and many buckets; "edge": a bucket
# exactly as large as its first two tensors (a cut only past the size, not at it)
BUCKET_BYTES = [ONE_BUCKET, 2**20, 40_000, 9_000, 1, "edge"]


def model_and_spec(arch: str, tied: bool):
    cfg = tiny_config()
    cfg.model.arch, cfg.model.tie_embeddings, cfg.model.n_layer = arch, tied, 3
    cfg.model.n_kv_head = 1 if arch == "llama" else 0
    model = build_model(cfg)
    return model, spec_of(cfg.model, cfg.train.seq_len)


def test_the_first_bucket_cap_is_the_runtimes():
    assert DDP_FIRST_BUCKET_BYTES == runtime_buckets.FIRST_BUCKET_BYTES


@pytest.mark.parametrize(("arch", "tied"), ARCHS)
def test_tensors_are_the_models_parameters_in_registration_order(arch, tied):
    model, spec = model_and_spec(arch, tied)
    assert chunk_tensors(spec, Layout(), 0) == [[p.numel() for p in model.parameters()]]


@pytest.mark.parametrize(("arch", "tied"), ARCHS)
@pytest.mark.parametrize("cap", BUCKET_BYTES)
def test_data_parallel_buckets_are_the_runtimes(arch, tied, cap):
    model, spec = model_and_spec(arch, tied)
    params = list(model.parameters())
    (tensors,) = chunk_tensors(spec, Layout(), 0)
    cap = 4 * (tensors[-1] + tensors[-2]) if cap == "edge" else cap  # filled from the last
    runtime = runtime_buckets.build_buckets(params, 0 if cap == ONE_BUCKET else cap)
    workload = Workload(precision=PRECISIONS["fp32"], bucket_bytes=cap)
    assert ddp_bucket_sizes(tensors, workload) == [b.buffer.numel() for b in runtime]


@pytest.mark.parametrize(("arch", "tied"), ARCHS)
@pytest.mark.parametrize("cap", BUCKET_BYTES)
@pytest.mark.parametrize(("precision", "k"), [("fp32", 3), ("mixed", 7), ("mixed", 1)])
def test_flat_buckets_are_the_runtimes(arch, tied, cap, precision, k):
    model, spec = model_and_spec(arch, tied)
    layout = FlatLayout(list(model.named_parameters())[::-1], k)  # as zero.py lays them
    (tensors,) = chunk_tensors(spec, Layout(), 0)
    elem = PRECISIONS[precision].grad_bytes
    cap = elem * (tensors[-1] + tensors[-2]) if cap == "edge" else cap  # laid out last first
    workload = Workload(precision=PRECISIONS[precision], bucket_bytes=cap)
    runtime = runtime_flat_buckets(layout, 0 if cap == ONE_BUCKET else cap, elem)
    planned = flat_bucket_sizes(tensors, workload, layout.padded)
    assert planned == [b.end - b.start for b in runtime]
    assert sum(planned) == layout.padded
