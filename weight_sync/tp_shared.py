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
from weight_sync.direct import DirectLoad
from weight_sync.in_place import EngineLayout
from weight_sync.node_buckets import _map, _shm_dir
from weight_sync.resharding import TPSpec, shard_for_rank


class TPSharedWeights:
    """TP rank r's parameters by vLLM name (aliases included) in `views[r]`, mapped here, for
    the ranks this process writes (every rank in the engine's process; one rank in each
    colocated trainer rank beside it)."""

    def __init__(self, spec: TPSpec, layouts: Mapping[int, EngineLayout],
                 maps: Mapping[int, mmap.mmap]):
        self.spec, self.layouts, self._maps = spec, dict(layouts), dict(maps)
        self.views = {r: layout.views(torch.frombuffer(self._maps[r], dtype=torch.uint8))
                      for r, layout in self.layouts.items()}

    @classmethod
    def create(cls, engine, spec: TPSpec) -> TPSharedWeights:
        """Have every rank of `engine` (a VLLMEngine) move its weights into shared memory, and
        map it. The files are unlinked once mapped: the memory lives while a mapping does."""
        files = cls.share(engine, spec)
        try:
            return cls.open(spec, files)
        finally:
            cls.unlink(files)

    @staticmethod
    def share(engine, spec: TPSpec) -> dict:
        """Every rank of `engine` moves its weights into a file of its own in shared memory;
        returns {"paths": [...], "layouts": [encoded EngineLayout, ...]} by TP rank, for `open`
        in this or another process of the host. The caller unlinks the files (`unlink`) once
        every process that writes them has opened them."""
        if spec.tp_size != engine.tp_size:
            raise ValueError(f"the TPSpec is for TP {spec.tp_size}, the engine runs TP "
                             f"{engine.tp_size}")
        layouts = [EngineLayout.of_described(params) for params in engine.rank_parameters()]
        tag = uuid.uuid4().hex
        paths = [os.path.join(_shm_dir(), f"rlstack-tp{r}-{tag}") for r in range(spec.tp_size)]
        places = [dict(layout.offsets(), __nbytes__=_file_bytes(layout)) for layout in layouts]
        files = {"paths": paths, "layouts": [layout.encode() for layout in layouts]}
        try:
            engine.share_rank_weights(paths, places)
        except BaseException:
            TPSharedWeights.unlink(files)
            raise
        return files

    @classmethod
    def open(cls, spec: TPSpec, files: dict, ranks: Iterable[int] | None = None
             ) -> TPSharedWeights:
        """Map the files `share` made, for `ranks` (default: all)."""
        ranks = range(spec.tp_size) if ranks is None else ranks
        layouts = {r: EngineLayout.decode(files["layouts"][r]) for r in ranks}
        maps = {r: _map(files["paths"][r], _file_bytes(layout)) for r, layout in layouts.items()}
        if None in maps.values():
            raise OSError(f"could not map the TP ranks' weights in {_shm_dir()} (is every "
                          f"writer on the engine's host?)")
        return cls(spec, layouts, maps)

    @staticmethod
    def unlink(files: dict) -> None:
        for path in files["paths"]:
            if os.path.exists(path):
                os.unlink(path)

    def write(self, weights: Iterable[tuple[str, torch.Tensor]],
              aliases: Mapping[str, str] | None = None, ranks: Iterable[int] | None = None
              ) -> dict[int, int]:
        """Write each (HF name, full tensor) as every held rank's slice (`ranks`: only those);
        `aliases`: extra engine name -> HF name (a tied head sent once). Returns the bytes
        written per rank; each rank is placed as `DirectLoad` places one engine (a tied head
        once), and every parameter must be covered (the vocab's padding rows excepted), else
        DirectLoadError, before the engine reads."""
        ranks = list(self.views) if ranks is None else list(ranks)
        loads = {r: DirectLoad(self.views[r], self.spec, tp_rank=r) for r in ranks}
        filled = {r: {} for r in ranks}
        written = dict.fromkeys(ranks, 0)
        with torch.no_grad():
            for name, full in weights:
                for target_name in names_for(name, dict(aliases or {})):
                    for r in ranks:
                        piece = shard_for_rank(target_name, full, self.spec, r)
                        written[r] += loads[r].place(target_name, piece, filled[r])
        for r in ranks:
            loads[r].check_complete(filled[r])
            written[r] *= next(iter(self.views[r].values())).element_size()  # one engine dtype
        return written


def _file_bytes(layout: EngineLayout) -> int:
    return max(layout.nbytes, 64)
