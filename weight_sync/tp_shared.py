"""The weights of a tensor-parallel engine's ranks, written in place from the engine's host.

At TP > 1 each rank of a vLLM engine is a worker process of its own. Each rank moves its
parameters (its slice, in vLLM's layout: fused q/k/v and gate/up, the padded vocab split) into
a file in shared memory, laid out as `EngineLayout` packs one engine (rollout.tp_worker); this
process maps every rank's file. A sync then writes, for each Hugging Face tensor, rank r's slice
(`resharding.shard_for_rank`: what vLLM's loader on rank r would keep) to its place in rank r's
memory (`local_param_slot`): each rank gets its slice and nothing else, no tensor crosses an RPC,
and the engine re-packs after (`VLLMEngine.weights_changed`).

Needs an engine whose ranks keep their weights as loaded (CPU: rollout.cpu_linear repack or
plain), on this host.
"""
from __future__ import annotations

import mmap
import os
import uuid
from typing import Iterable, Mapping

import torch

from weight_sync.buckets import names_for
from weight_sync.direct import RELOAD_HINT, DirectLoadError
from weight_sync.in_place import EngineLayout
from weight_sync.node_buckets import _shm_dir
from weight_sync.resharding import TPSpec, local_param_slot, shard_for_rank


class TPSharedWeights:
    """Rank r's parameters by vLLM name (aliases included) in `views[r]`, mapped here."""

    def __init__(self, spec: TPSpec, layouts: list[EngineLayout], maps: list[mmap.mmap]):
        self.spec, self.layouts, self._maps = spec, layouts, maps
        self.views = [layout.views(torch.frombuffer(m, dtype=torch.uint8))
                      for layout, m in zip(layouts, maps)]

    @classmethod
    def create(cls, engine, spec: TPSpec) -> TPSharedWeights:
        """Have every rank of `engine` (a VLLMEngine) move its weights into shared memory, and
        map it. The files are unlinked once mapped: the memory lives while a mapping does."""
        if spec.tp_size != engine.tp_size:
            raise ValueError(f"the TPSpec is for TP {spec.tp_size}, the engine runs TP "
                             f"{engine.tp_size}")
        layouts = [EngineLayout.of_described(params) for params in engine.rank_parameters()]
        tag = uuid.uuid4().hex
        paths = [os.path.join(_shm_dir(), f"rlstack-tp{r}-{tag}") for r in range(spec.tp_size)]
        places = [dict(layout.offsets(), __nbytes__=max(layout.nbytes, 64)) for layout in layouts]
        try:
            engine.share_rank_weights(paths, places)
            maps = []
            for path, layout in zip(paths, layouts):
                fd = os.open(path, os.O_RDWR)
                try:
                    maps.append(mmap.mmap(fd, max(layout.nbytes, 64)))
                finally:
                    os.close(fd)
        finally:
            for path in paths:
                if os.path.exists(path):
                    os.unlink(path)
        return cls(spec, layouts, maps)

    def write(self, weights: Iterable[tuple[str, torch.Tensor]],
              aliases: Mapping[str, str] | None = None, ranks: Iterable[int] | None = None
              ) -> list[int]:
        """Write each (HF name, full tensor) as every rank's slice (`ranks`: only those, e.g. a
        rank's own writer); `aliases`: extra engine name -> HF name (a tied head sent once).
        Returns the elements written per rank; every engine parameter must be covered (the
        vocab's padding rows excepted), else DirectLoadError, before the engine reads."""
        ranks = list(range(self.spec.tp_size)) if ranks is None else list(ranks)
        written = [0] * self.spec.tp_size
        with torch.no_grad():
            for name, full in weights:
                seen = set()
                for target_name in names_for(name, dict(aliases or {})):
                    target, row = local_param_slot(target_name, self.spec)
                    stored = self.layouts[0].aliases.get(target, target)
                    if stored in seen:  # a head the engine ties too: the same memory
                        continue
                    seen.add(stored)
                    for r in ranks:
                        if stored not in self.views[r]:
                            raise DirectLoadError(f"{target_name!r} goes to parameter "
                                                  f"{target!r}, which TP rank {r} does not "
                                                  f"have; {RELOAD_HINT}")
                        piece = shard_for_rank(target_name, full, self.spec, r)
                        self.views[r][stored].narrow(0, row, piece.shape[0]).copy_(piece)
                        written[r] += piece.numel()
        for r in ranks:
            want = self.layouts[r].sent_numel(self.spec, r)
            if written[r] != want:
                raise DirectLoadError(f"a sync wrote {written[r]} elements of TP rank {r}'s "
                                      f"weights, which has {want}: the trainer and engine "
                                      f"models differ (a parameter missing on one side)")
        return written
