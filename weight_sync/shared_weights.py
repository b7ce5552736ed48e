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

from weight_sync.direct import DirectLoadError
from weight_sync.node_buckets import same_host, shard_part, shared_memory
from weight_sync.resharding import TPSpec, is_vocab, local_param_slot

ALIGN = 64  # bytes: each parameter starts on a cache line


class SharedWeights:
    """`views`: every engine parameter name (aliases included) -> its tensor in shared memory."""

    def __init__(self, params: Mapping[str, torch.Tensor], spec: TPSpec, first: dict[int, str],
                 offsets: dict[str, int], mapped: tuple):
        import torch.distributed as dist

        self.spec, self.rank, self.world = spec, dist.get_rank(), dist.get_world_size()
        self._map, memory = mapped
        shared = {}
        for name, offset in offsets.items():
            p = params[name]
            view = memory[offset:offset + p.numel() * p.element_size()].view(p.dtype)
            shared[name] = view.view(p.shape)
            if self.rank == 0:
                shared[name].copy_(p)  # the padding rows (never sent) keep the engine's values
        dist.barrier()
        self.views = {name: shared[first[p.data_ptr()]] for name, p in params.items()}
        # every element a sync must write: all of each parameter but the vocab's padding rows
        self.expected = sum(_sent_numel(name, view, spec) for name, view in shared.items())

    @classmethod
    def create(cls, params: Mapping[str, torch.Tensor], spec: TPSpec) -> SharedWeights | None:
        """Collective over the trainer world; None unless every rank is on this host and the
        weights fit in shared memory."""
        if not same_host():
            return None
        first: dict[int, str] = {}  # storage -> the first name it has
        for name, p in params.items():
            first.setdefault(p.data_ptr(), name)
        offsets, end = {}, 0
        for name in first.values():
            offsets[name] = end
            end += -(-params[name].numel() * params[name].element_size() // ALIGN) * ALIGN
        mapped = shared_memory(max(end, ALIGN))
        return None if mapped is None else cls(params, spec, first, offsets, mapped)

    def write(self, module: torch.nn.Module, aliases: Mapping[str, str]) -> int:
        """Write this rank's shard of every parameter of `module` (HF names; `aliases`: extra
        engine name -> trainer name, a tied head) in place; collective. Returns the elements
        all ranks wrote, after checking that they cover every engine parameter."""
        import torch.distributed as dist

        written = 0
        with torch.no_grad():
            for name, p in module.named_parameters():
                part, start = shard_part(p, self.rank, self.world)
                targets = [name] + [a for a, source in aliases.items() if source == name]
                seen = set()
                for target_name in targets:
                    target, offset = local_param_slot(target_name, self.spec)
                    view = self.views.get(target)
                    if view is None:
                        raise DirectLoadError(f"{target_name!r} goes to engine parameter "
                                              f"{target!r}, which the engine does not have")
                    if view.data_ptr() in seen:  # a head the engine ties too: same storage
                        continue
                    seen.add(view.data_ptr())
                    rows = _full_rows(p)
                    flat = view.narrow(0, offset, rows).reshape(-1) if view.dim() else view
                    flat[start:start + part.numel()].copy_(part)
                    written += part.numel()
        total = torch.tensor([written], dtype=torch.int64)
        dist.all_reduce(total)  # also the barrier: every rank has written its part
        if int(total) != self.expected:
            raise DirectLoadError(
                f"the trainer ranks wrote {int(total)} elements of the shared engine weights, "
                f"the engine has {self.expected}: the trainer and engine models differ (a "
                f"parameter missing on one side, or a tied head the trainer does not send)")
        return int(total)


def _sent_numel(name: str, view: torch.Tensor, spec: TPSpec) -> int:
    if view.dim() == 0:
        return 1
    rows = min(view.shape[0], spec.vocab_size) if is_vocab(name) else view.shape[0]
    return rows * (view.numel() // view.shape[0])


def _full_rows(p: torch.nn.Parameter) -> int:
    shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
    return shape[0] if shape else 1
