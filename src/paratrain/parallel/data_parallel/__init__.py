"""Data parallelism, one family: every wrapper keeps a replica's gradients in sync over a
group and answers the `Replica` protocol (replica.py), so the step never asks which one.
What the wrappers share: grad_lists.py (norms, scaling, one all-reduce over a list),
whole_module.py (the protocol's answers for gradients kept whole), memory_count.py (bytes
held, each storage once).

wrapper.py: `DataParallel`, whole gradients all-reduced in buckets (buckets.py) as
backward produces them, `no_sync()` from sync_switch.py; zero.py: ZeRO-1/2 over flat
shards (flat_buffer.py, sharded_replica.py); fsdp.py: ZeRO-3 / FSDP, parameters gathered
per unit (fsdp_units.py); param_share.py: which parameters a wrapper syncs, over which
group (experts over expert-dp); async_sgd.py and dc_asgd.py: the parameter server (its
state: async_state.py) and delay compensation (--dp-mode async); adamw.py: AdamW over
whole parameters or over ZeRO's flat shards, with the loss scaler.
Imports `comm` and `config` and the rest of `parallel/`; no model, no training code.
"""

from paratrain.parallel.data_parallel.wrapper import DataParallel, broadcast_parameters

__all__ = ["DataParallel", "broadcast_parameters"]
