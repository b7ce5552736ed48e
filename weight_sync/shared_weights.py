"""Colocated engines of one CPU machine share one copy of their weights; trainer ranks write
their own shards straight into it.

Colocated, every engine holds the same policy version, and trainer and engines take turns. So
the engines' parameters (vLLM names and layout: fused q/k/v and gate/up, padded vocab) can live
once in shared memory, mapped by every rank of the machine. A sync is then each trainer rank
copying its own ZeRO-3 shard of every parameter to its place there (rank r's elements
[r * s, (r + 1) * s) of a flattened HF tensor land in the same element range of the tensor's
rows in the fused parameter, `local_param_slot`), and one all-reduce of the element counts,
which checks that nothing was missed and is the barrier after which every engine may read.
No gather, no bucket, no second copy; and one copy of the weights per machine instead of one
per engine.

Needs engines that keep their weights as loaded (see `weight_sync.direct`) and trainer ranks
on one host; `SharedWeights.create` returns None otherwise (then `NodeBuckets` or DeepSpeed).
"""
from __future__ import annotations

from typing import Mapping

import torch

from weight_sync.buckets import full_shape
from weight_sync.direct import DirectLoadError
from weight_sync.in_place import EngineLayout, place_in_engine
from weight_sync.node_buckets import same_host, shared_memory, write_shards
from weight_sync.resharding import TPSpec


class SharedWeights:
    """`views`: every engine parameter name (aliases included) -> its tensor in shared memory,
    laid out as `EngineLayout` packs the engine."""

    def __init__(self, params: Mapping[str, torch.Tensor], spec: TPSpec, layout: EngineLayout,
                 mapped: tuple):
        import torch.distributed as dist

        self.spec, self.layout = spec, layout
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._map, self._memory = mapped
        self.views = layout.views(self._memory)
        if self.rank == 0:  # the vocab's padding rows are never sent: they keep these values
            for meta in layout.tensors:
                self.views[meta.name].copy_(params[meta.name])
        dist.barrier()
        self.expected = layout.sent_numel(spec)

    @classmethod
    def create(cls, params: Mapping[str, torch.Tensor], spec: TPSpec) -> SharedWeights | None:
        """Collective over the trainer world; None unless every rank is on this host and the
        weights fit in shared memory."""
        if not same_host():
            return None
        layout = EngineLayout.of(params)
        mapped = shared_memory(max(layout.nbytes, 64))
        return None if mapped is None else cls(params, spec, layout, mapped)

    def write(self, module: torch.nn.Module, aliases: Mapping[str, str]) -> int:
        """Write this rank's shard of every parameter of `module` (HF names; `aliases`: extra
        engine name -> trainer name, a tied head) in place; collective. Returns the elements
        all ranks wrote, after checking that they cover every engine parameter.

        Where each tensor goes is checked before anything is written, alike on every rank (a
        raise on some ranks only would leave the others waiting in the all-reduce)."""
        import torch.distributed as dist

        by_name = dict(module.named_parameters())
        placed, _ = place_in_engine(self.layout, [(n, full_shape(p)) for n, p in by_name.items()],
                                    aliases, self.spec)
        with torch.no_grad():
            written = write_shards(self._memory, placed, [by_name[m.name] for m in placed],
                                   self.rank, self.world)
        total = torch.tensor([written], dtype=torch.int64)
        dist.all_reduce(total)  # also the barrier: every rank has written its part
        if int(total) != self.expected:
            raise DirectLoadError(
                f"the trainer ranks wrote {int(total)} elements of the shared engine weights, "
                f"the engine has {self.expected}: the trainer and engine models differ (a "
                f"parameter missing on one side, or a tied head the trainer does not send)")
        return int(total)
