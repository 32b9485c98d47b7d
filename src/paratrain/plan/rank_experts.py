"""A mixture of experts on each rank of paratrain's own runtime: the parameter shares and
what their layers send (train/experts.py, parallel/expert_parallel/, models/moe.py).

Shares. With ep 1 every rank holds the whole model, one share over dp_cp. With ep > 1 the
data-parallel wrapping splits in two, each a flat buffer of its own for ZeRO-1/2:
- dense (attention, norms, embeddings, every layer's router and shared expert), over
  dp_cp: what a dense model holds, less its MLPs, plus the routers and shared experts;
- experts: E/ep of every layer's experts, over expert_dp (dp_cp / ep ranks).
Under HSDP each share shards within its replica group (dense over dp_shard, experts over
expert_shard: mesh_shape.py) and all-reduces its gradient shards over dp_replicate.
Under ZeRO-3 each share is the flat buffers of its units, each padded on its own: the
dense share the model's units (a block's holding its router and shared expert, and its
experts with ep 1; a tied table the root), the experts one unit per layer.
Under tensor parallelism the MoE stays whole on every tp rank (models/plans.py
`_moe_tp_plan`): the MLP's two tp all-reduces per block and pass are gone.

Traffic per step, K micro-batches, L MoE layers, b s tokens a micro-batch:
- dp_cp: each layer's forward all-gathers every shard's routing counts, (k, E) int64; the
  step's auxiliary loss, one float64, is averaged once (bookkeeping); plain DataParallel
  (ZeRO 0 in fp32) broadcasts the layers' buffers, the router's bias and the load, 2 E
  float32, from the group's rank 0 before every forward;
- ep: each layer's forward sends E/ep int64 counts to every other ep rank, then the
  tokens go to their experts and back, forward and backward. With a balanced router and
  nothing dropped a rank's k N assignments leave it with probability (ep - 1)/ep and as
  many arrive: 2 k N d e (ep - 1)/ep per layer and pass (plan/moe.py with iota = 1). The
  real router's choices differ step by step: that term is marked `routed`, the rest is
  exact. The experts' gradient-norm squares, two float64, are summed over ep (and under
  ZeRO over the group their shards split over first, expert_dp or expert_shard:
  train/clip.py).
Per pipeline stage, its own blocks. Recomputation routes every layer again in backward:
its counts and all-to-alls twice, its tokens in three passes; DataParallel's broadcast
stays once (the recomputation calls the block, not the wrapper).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.config import ModelConfig
from paratrain.models.presets import feed_forward_params, ffn_width
from paratrain.plan import comm
from paratrain.plan.expert_cost import COUNT_BYTES, counts_bytes, expected_token_bytes
from paratrain.plan.layout import Layout, Workload, flat_buffered
from paratrain.plan.memory import ModelState
from paratrain.plan.model import ModelSpec, spec_of
from paratrain.plan.muon import momentum_elements
from paratrain.plan.muon_shards import optimizer_elements, unpadded_elements
from paratrain.plan.pipeline import stage_layers, stage_virtual_stages, virtual_stage_layers
from paratrain.plan.rank_groups import (
    Coords,
    RankTraffic,
    data_rank,
    ep_rank,
    expert_dp_rank,
    expert_shard_rank,
    group_name,
    shard_rank,
)
from paratrain.plan.rank_memory import (
    STATE_KINDS,
    buffers_model_state,
    chunk_params,
    exact,
    flat_buffers,
    tied_root,
)

BUFFER_BYTES = 4  # the router's bias and the layer's load, float32


@dataclass(frozen=True)
class ExpertCounts:
    """A run's mixture of experts, as the per-rank counts need it (config.ModelConfig)."""

    num_experts: int
    top_k: int
    expert: int  # one expert's parameters in one layer
    moe: int  # one layer's whole MoE: router, experts, shared expert
    mlp_split: int  # the dense MLP it replaces: parameters tp splits ...
    mlp_replicated: int  # ... and those it replicates (models/plans.py)

    @classmethod
    def of(cls, m: ModelConfig) -> ExpertCounts | None:
        if not m.num_experts:
            return None
        h, f = m.d_model, ffn_width(m)
        dense = replace(m, num_experts=0, shared_expert=False)
        # gpt: fc (weight and bias) and proj split, proj's bias replicated; llama: SwiGLU.
        replicated = h if m.arch == "gpt" else 0
        split = feed_forward_params(dense) - replicated
        expert = (2 if m.arch == "gpt" else 3) * h * f
        return cls(m.num_experts, m.top_k, expert, feed_forward_params(m), split, replicated)


def run_model(m: ModelConfig, seq_len: int) -> tuple[ModelSpec, ExpertCounts | None]:
    """A run's [model] as the per-rank counts take it: the spec (for a mixture of experts,
    the dense model of the same shape, whose MLPs `ExpertCounts` replaces) and its experts."""
    experts = ExpertCounts.of(m)
    return spec_of(replace(m, num_experts=0) if experts else m, seq_len), experts


@dataclass(frozen=True)
class Share:
    """Parameters one data-parallel wrapper keeps in sync, and over which group."""

    params: int  # this rank's
    kind: str  # "dp_cp" or "expert_dp"
    size: int  # ranks in the group
    rank: int  # this rank's place in it
    buffers: tuple[int, ...] = ()  # ZeRO's flat buffers, parameters each (default: one)
    root: int = 0  # ZeRO-3's tied root unit, the first buffer (rank_memory.tied_root)

    @property
    def flat(self) -> list[int]:
        return list(self.buffers or (self.params,))

    @property
    def shard_kind(self) -> str:
        """The group ZeRO shards it over under HSDP: its kind's part of a replica group."""
        return "dp_shard" if self.kind == "dp_cp" else "expert_shard"


def shares(model: ModelSpec, experts: ExpertCounts, layout: Layout, at: Coords) -> list[Share]:
    """The rank's shares (module docstring), per chunk of its pipeline stage: each chunk is
    wrapped on its own. `model` is the dense model of the same shape."""
    pieces = virtual_stage_layers(model.n_layer or 0, layout.pp, layout.chunks)
    chunks = stage_virtual_stages(at.stage, layout.pp, layout.chunks)
    units = layout.zero == 3 and exact(model)  # ZeRO-3: a buffer per unit
    per_layer = experts.mlp_split // layout.tp + experts.mlp_replicated
    split_layer = experts.num_experts * experts.expert if layout.ep > 1 else 0
    delta = experts.moe - per_layer - split_layer  # a dense share's block beyond the model's
    unit_buffers = flat_buffers(model, layout, at.stage, delta) if units else []
    root = tied_root(model, layout, at.stage)
    out = []
    for i, (whole, vs) in enumerate(
        zip(chunk_params(model, layout, at.stage), chunks, strict=True)
    ):
        layers = pieces[vs]
        dense_params = whole + layers * delta
        buffers = tuple(unit_buffers[i]) if units else ()
        assert not buffers or sum(buffers) == dense_params
        at_dp = data_rank(layout, at)
        out.append(Share(dense_params, "dp_cp", layout.data_ranks, at_dp, buffers, root))
        if split_layer:
            size, mine = layout.data_ranks // layout.ep, split_layer // layout.ep
            buffers = (mine,) * layers if units else ()
            rank = expert_dp_rank(layout, at)
            out.append(Share(mine * layers, "expert_dp", size, rank, buffers))
    return out


def dense_moe(experts: ExpertCounts | None, ep: int) -> int:
    """Parameters of one block's mixture of experts in the dense share: router and shared
    expert, and the experts themselves at ep 1 (whole on every tp rank); 0 without one."""
    if experts is None:
        return 0
    return experts.moe - (experts.num_experts * experts.expert if ep > 1 else 0)


def share_layout(share: Share, layout: Layout) -> Layout:
    """The share's group as the dense counts take it: its data-parallel ranks, in the
    run's replica groups (each holds every expert: mesh_shape.py)."""
    return Layout(dp=share.size, zero=layout.zero, replicas=layout.replicas)


def expert_model_state(
    model: ModelSpec, experts: ExpertCounts, workload: Workload, layout: Layout, at: Coords
) -> ModelState:
    """Model-state bytes of a rank, itemised as the runtime records them: its shares'.
    Under Muon the dense share's optimizer state is plan/muon_shards.py's (or one momentum
    per whole matrix), the experts' AdamW's, without moments for padding when sharded."""
    states, held = [], 0  # held: optimizer elements when Muon works over flat shards
    sharded = bool(workload.muon_ns_bytes) and flat_buffered(workload, layout)
    for share in shares(model, experts, layout, at):
        lay = share_layout(share, layout)
        states.append(buffers_model_state(share.flat, workload, lay))
        if sharded and share.kind != "dp_cp":
            k = lay.shard_ranks if layout.zero else 1
            held += 2 * unpadded_elements(share.flat, k, expert_shard_rank(layout, at) % k)
    state = ModelState(*(sum(getattr(st, kind) for st in states) for kind in STATE_KINDS))
    if not workload.muon_ns_bytes:
        return state
    moe, moment = dense_moe(experts, layout.ep), workload.precision.moment_bytes
    if sharded:
        me = shard_rank(layout, at) if layout.zero else 0
        held += optimizer_elements(model, layout, at.stage, me, moe)
        return replace(state, optimizer=moment * held)
    whole = momentum_elements(model, layout, at.stage, moe)  # one moment instead of two
    return replace(state, optimizer=state.optimizer - moment * whole)


def tp_activation_bytes(
    model: ModelSpec, workload: Workload, layout: Layout, k: int, stage: int = 0
) -> int:
    """The tp all-reduces of activations with MoE blocks on pipeline stage `stage`:
    attention's two per block (its output in forward, its input's gradient in backward),
    the embedding's and the head's where that stage holds them."""
    if layout.tp == 1:
        return 0
    s, v = layout.pp, layout.chunks
    mine = stage_virtual_stages(stage, s, v)
    ends = (0 in mine) + (s * v - 1 in mine)
    calls = k * (2 * stage_layers(model.n_layer or 0, stage, s, v) + ends)
    size = comm.activation_message_bytes(model, workload, layout.cp)
    return calls * comm.all_reduce_bytes(size, layout.tp)


def moe_terms(
    model: ModelSpec, experts: ExpertCounts, workload: Workload, layout: Layout, k: int, at: Coords
) -> list[RankTraffic]:
    """Routing, buffers and expert traffic of a rank (module docstring)."""
    forwards = k * stage_layers(model.n_layer or 0, at.stage, layout.pp, layout.chunks)
    # Recomputation (full or selective) routes each layer again in backward: its count
    # gathers and all-to-alls run twice, its tokens travel in three passes, not two.
    recomputed = workload.recompute != "none"
    calls, passes, e = forwards * (1 + recomputed), 2 + recomputed, experts.num_experts
    size, rank, dp = layout.data_ranks, data_rank(layout, at), group_name("dp_cp", layout)
    out = []
    if size > 1:
        counts = calls * (size - 1) * experts.top_k * e * COUNT_BYTES  # ring all-gather
        out.append(RankTraffic(dp, "all_gather", "routing counts of every shard", counts))
        aux = comm.ring_all_reduce_rank_bytes(1, 8, size, rank)
        out.append(RankTraffic(dp, "all_reduce", "auxiliary loss, float64", aux, True))
        # DataParallel's forward; a pipeline's runtime calls the chunks themselves
        if layout.zero == 0 and workload.precision.name == "fp32" and layout.pp == 1:
            sends = rank != size - 1  # a chain from rank 0
            nbytes = forwards * 2 * e * BUFFER_BYTES * sends  # not in a recomputation
            out.append(RankTraffic(dp, "broadcast", "router bias and load buffers", nbytes, True))
    ep = layout.ep
    if ep == 1:
        return out
    counts = calls * counts_bytes(e, ep)
    tokens = workload.micro_batch * (model.seq_len or 0) // layout.cp  # a rank's, whole on tp
    elem = workload.precision.activation_bytes
    per_pass = expected_token_bytes(tokens, experts.top_k, ep, model.shape.d_model, elem)
    balanced = forwards * passes * per_pass
    what = "tokens to their experts and back, in every pass (balanced router)"
    out += [
        RankTraffic("ep", "all_to_all", "routing counts", counts),
        RankTraffic("ep", "all_to_all", what, round(balanced), routed=True),
    ]
    shard = size // (ep * layout.replicas)  # ZeRO's shards of the experts: expert_shard
    norms = [("expert_shard", shard, expert_shard_rank(layout, at))] if layout.zero else []
    for kind, n, r in [*norms, ("ep", ep, ep_rank(layout, at))]:
        sent = comm.ring_all_reduce_rank_bytes(2, 8, n, r)
        if sent:
            what = "experts' gradient-norm squares, float64"
            out.append(RankTraffic(group_name(kind, layout), "all_reduce", what, sent, True))
    return out
