"""torch.distributed.checkpoint planners that store `Sharded` boxes as chunks of global tensors.

DCP's own planners understand plain tensors (stored whole, deduplicated across ranks by
key) and DTensors (one even chunk per rank). A ZeRO shard of a parameter is neither: it
is a few boxes (state.py). These planners extend DCP's defaults by one case:
a `Sharded` value writes one chunk per box, each keyed by its global offsets, and on load
asks DCP for exactly its boxes, which DCP assembles from whatever chunks the saving mesh
wrote (its resharding algorithm). Identical boxes written by several ranks (replicated
parameters) are deduplicated like identical keys; DCP's global-plan validation checks that
the chunks tile every tensor without overlap.

Keys the checkpoint lacks, or whose global shape differs, raise `CheckpointMismatch`
naming the key: a checkpoint of another model never loads silently.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

from paratrain.checkpoint.state import Sharded


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold what this model and layout need."""


def _write_item(fqn: str, value: Sharded, box_index: int) -> WriteItem:
    box = value.boxes[box_index]
    offsets = torch.Size(box.offsets)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=box.data.size()),
            properties=TensorProperties.create_from_tensor(box.data),
            size=value.shape,
        ),
    )


class ShardedSavePlanner(DefaultSavePlanner):
    """Save a flat {key: Sharded | tensor | object} dict (no nesting, no flattening)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, value in self.state_dict.items():
            if isinstance(value, Sharded):
                items += [_write_item(fqn, value, i) for i in range(len(value.boxes))]
            else:
                items += _create_write_items(fqn, value)
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> object:
        value = self.state_dict[index.fqn]
        if not isinstance(value, Sharded):
            return super().lookup_object(index)
        for box in value.boxes:
            if torch.Size(box.offsets) == index.offset:
                return box.data
        raise KeyError(f"no box of {index.fqn} at {tuple(index.offset or ())}")


class ShardedLoadPlanner(DefaultLoadPlanner):
    """Load into a flat {key: Sharded | tensor | object} dict, in place."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DCP's set-up walks the dict and replaces values it does not know by None.
        ours = {k: v for k, v in state_dict.items() if isinstance(v, Sharded)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.state_dict.update(ours)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        requests: list[ReadItem] = []
        for fqn, value in self.state_dict.items():
            if fqn not in saved:
                raise CheckpointMismatch(f"the checkpoint has no {fqn!r}")
            md = saved[fqn]
            if not isinstance(value, Sharded):
                requests += _create_read_items(fqn, md, value)
                continue
            if not isinstance(md, TensorStorageMetadata) or md.size != value.shape:
                found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "no tensor"
                raise CheckpointMismatch(
                    f"{fqn!r} has shape {found} in the checkpoint but {tuple(value.shape)} "
                    "in this model"
                )
            chunks = [
                ChunkStorageMetadata(torch.Size(b.offsets), b.data.size()) for b in value.boxes
            ]
            requests += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if not isinstance(value, Sharded):
            return super().lookup_tensor(index)
        assert index.index is not None, index  # the position in our chunk list, always set
        return value.boxes[index.index].data
