"""The weights of a tensor-parallel engine's ranks, written in place from the engine's host.

At TP > 1 each rank of a vLLM engine is a worker process of its own. Each rank moves its
parameters (its slice, in vLLM's layout: fused q/k/v and gate/up, the padded vocab split) into
a file in shared memory, laid out as `EngineLayout` packs one engine (rollout.tp_worker); this
process maps every rank's file. A sync then writes, for each Hugging Face tensor, rank r's slice
(`resharding.shard_for_rank`: what vLLM's loader on rank r would keep) to its place in rank r's
memory (`local_param_slot`): each rank gets its slice and nothing else, no tensor crosses an RPC,
and the engine re-packs after (`VLLMEngine.weights_changed`).

Colocated, the trainer ranks beside the engine map every rank's memory too, and each writes
its own ZeRO-3 shard of every parameter straight to the TP ranks' slices (`write_shards`): the
flat element range [r s, (r + 1) s) a trainer rank holds is cut into row blocks, and each block
meets each TP rank's slice (a range of rows, or of columns for row-parallel weights) in a
rectangle, copied to its place. Each element is written once per TP rank that keeps it, by the
trainer rank that holds it: no gather, no rank writes the whole model, and each TP rank receives
its slice only.

Needs an engine whose ranks keep their weights as loaded (CPU: rollout.cpu_linear repack or
plain), on this host.
"""
from __future__ import annotations

import mmap
import os
import uuid
from typing import Iterable, Mapping

import torch

from weight_sync.buckets import full_shape, names_for
from weight_sync.direct import DirectLoadError
from weight_sync.in_place import EngineLayout
from weight_sync.layout import TRAILER
from weight_sync.node_buckets import _map, _shm_dir, shard_part
from weight_sync.resharding import TPSpec, copy_into_slice, local_param_slot, shard_range


class TPSharedWeights:
    """TP rank r's memory (`memory[r]`, uint8) and its parameters by vLLM name (aliases
    included, `views[r]`), mapped here: in the engine's actor, and in every colocated trainer
    rank of the host."""

    def __init__(self, spec: TPSpec, layouts: Mapping[int, EngineLayout],
                 maps: Mapping[int, mmap.mmap]):
        self.spec, self.layouts, self._maps = spec, dict(layouts), dict(maps)
        self.memory = {r: torch.frombuffer(m, dtype=torch.uint8) for r, m in self._maps.items()}
        self.views = {r: layout.views(self.memory[r]) for r, layout in self.layouts.items()}
        self.written = dict.fromkeys(self.layouts, 0)  # bytes per rank of the last `write`

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
    def open(cls, spec: TPSpec, files: dict) -> TPSharedWeights:
        """Map the files `share` made, every rank's."""
        layouts = {r: EngineLayout.decode(files["layouts"][r]) for r in range(spec.tp_size)}
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
        written per rank (kept as `written`); every element of every slice must be written (the vocab's padding
        rows excepted), else DirectLoadError, before the engine reads."""
        ranks = list(self.views) if ranks is None else list(ranks)
        written = dict.fromkeys(ranks, 0)
        done: set = set()
        with torch.no_grad():
            for name, full in weights:
                counts = self._place(name, full.reshape(-1), 0, list(full.shape),
                                     dict(aliases or {}), ranks, done)
                for r in ranks:
                    written[r] += counts[r]
        expected = self.expected()
        check_filled([written[r] for r in ranks], [expected[r] for r in ranks])
        self.written = {r: n * self.itemsize(r) for r, n in written.items()}
        return self.written

    def write_shards(self, params: Iterable[tuple[str, torch.nn.Parameter]],
                     aliases: Mapping[str, str], rank: int, world: int) -> dict[int, int]:
        """Write trainer rank `rank`'s part (of `world`) of each (HF name, parameter) straight to
        every held TP rank's slice; `aliases`: extra engine name -> HF name (a tied head). A
        ZeRO-3 parameter's part is its shard, a whole one an equal element range of it
        (node_buckets.shard_part). Returns the elements written into each TP rank; over all
        trainer ranks they must add up to `expected()`."""
        written = dict.fromkeys(self.views, 0)
        done: set = set()
        with torch.no_grad():
            for name, p in params:
                part, start = shard_part(p, rank, world)
                counts = self._place(name, part, start, full_shape(p), dict(aliases),
                                     list(self.views), done)
                for t, n in counts.items():
                    written[t] += n
        return written

    def _place(self, name: str, part: torch.Tensor, start: int, shape: list[int],
               aliases: dict[str, str], ranks: list[int], done: set) -> dict[int, int]:
        """Copy `part` (flat elements [start, ...) of HF tensor `name` of `shape`) into each of
        `ranks`' slices of it, by every engine name it has (`done`: the (rank, storage, row)
        places written already: a tied head's second name); elements copied per rank."""
        cols = shape[1] if len(shape) > 1 else 1
        copied = dict.fromkeys(ranks, 0)
        for target_name in names_for(name, aliases):
            slot, offset = local_param_slot(target_name, self.spec)
            for t in ranks:
                dst = self.views[t].get(slot)
                if dst is None:
                    raise DirectLoadError(f"{name!r} goes to engine parameter {slot!r}, which TP "
                                          f"rank {t} does not have: the trainer and engine "
                                          f"models differ")
                if (t, dst.data_ptr(), offset) in done:
                    continue
                done.add((t, dst.data_ptr(), offset))
                shard = shard_range(target_name, tuple(shape), self.spec, t)
                copied[t] += copy_into_slice(part, start, cols, shard,
                                             dst.view(dst.shape[0], -1), offset)
        return copied

    def itemsize(self, rank: int) -> int:
        return next(iter(self.views[rank].values())).element_size()  # one engine dtype

    def expected(self) -> dict[int, int]:
        """The elements a sync fills in each held TP rank: all but the vocab's padding rows."""
        return {t: layout.sent_numel(self.spec, t) for t, layout in self.layouts.items()}


def check_filled(written: list[int], expected: list[int]) -> None:
    """Raise DirectLoadError unless a sync wrote every element of every TP rank's slice
    (`written`, `expected`: per TP rank; colocated, summed over the trainer ranks)."""
    short = [f"TP rank {i} got {w} of {e} elements"
             for i, (w, e) in enumerate(zip(written, expected, strict=True)) if w != e]
    if short:
        raise DirectLoadError(f"the sync left TP slices unfilled: {'; '.join(short)} (TP ranks "
                              f"in engine order); the trainer and engine models differ (a tied "
                              f"head the trainer does not send?), or a trainer rank skipped "
                              f"its part")


def _file_bytes(layout: EngineLayout) -> int:
    # and room for an in-place bucket's checksum after the last byte (weight_sync.in_place)
    return max(layout.nbytes, 64) + TRAILER
