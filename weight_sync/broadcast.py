"""The disaggregated sync's two sides, each kept for its actor's life and each returning one
`SyncReport`: `BroadcastSender` on every trainer rank (rank 0 broadcasts, the others help
assemble buckets) and `BroadcastReceiver` beside each engine. The placement fans a sync out to
them and joins their reports (weight_sync.report.broadcast); the bytes go through
`weight_sync.transport.BroadcastTransport`.
"""
from __future__ import annotations

import time

import torch

from weight_sync.collective import CollectiveGroup
from weight_sync.report import SyncReport
from weight_sync.resharding import TPSpec


class BroadcastSender:
    """A trainer rank's side: its shared-memory bucket slots (weight_sync.node_buckets, made on
    the first send; False when the ranks span machines, train on GPUs, or /dev/shm is too
    small) and the engines' packed layouts by TP rank (weight_sync.in_place), once told."""

    def __init__(self, group: CollectiveGroup | None):
        self.group = group  # None on trainer ranks > 0 (they assemble, rank 0 broadcasts)
        self.slots = None
        self.engine_layout = None

    def set_engine_layout(self, encoded: str | None) -> None:
        """The engines' packed layouts (weight_sync.in_place.encode_layouts), or None: buckets of
        the trainer's own tensors."""
        from weight_sync.in_place import decode_layouts

        self.engine_layout = None if encoded is None else decode_layouts(encoded)

    def send(self, module: torch.nn.Module, hf_config, version: int, bucket_bytes: int,
             checksum: str) -> SyncReport:
        """Offer `module`'s weights as policy `version` (every trainer rank calls this); cut from
        the engines' layout when known (in place), else in the trainer's own buckets."""
        from weight_sync.transport import BroadcastTransport

        t0 = time.perf_counter()
        engine = None
        if self.engine_layout is not None:
            engine = (self.engine_layout, TPSpec.from_hf_config(hf_config,
                                                                len(self.engine_layout)))
        transport = BroadcastTransport(self.group, bucket_bytes, checksum, self.slots, engine)
        stats = transport.send(module, version)
        self.slots = transport.shared
        report = SyncReport.of(stats, "send", ways={"in_place": transport.in_place})
        report.phases = {"send": time.perf_counter() - t0, **report.phases}
        return report

    def exact_digests(self, module: torch.nn.Module, hf_config, rank: int, world: int) -> list:
        """This rank's `weight_sync.exact` digests of what the last in-place send wrote, for the
        engines to check their parameters against (TP 1 engines)."""
        from weight_sync.exact import trainer_digests

        spec = TPSpec.from_hf_config(hf_config, 1)
        return trainer_digests(self.engine_layout[0], spec, module, rank, world)


class BroadcastReceiver:
    """An engine's side: takes each version from the group into the engine's packed buffer (in
    place), or through its `load_weights` (weight_sync.direct, or vLLM's reload)."""

    def __init__(self, group: CollectiveGroup):
        self.group = group

    def receive(self, engine, version: int, direct_load: bool, packed=None,
                tp_shared=None) -> SyncReport:
        """Load policy `version` into `engine` (`load_weights`, `weights_changed`, `tp_size`);
        raises WeightSyncError if it did not arrive whole. direct_load: the engine copies each
        tensor as it comes (its buffers can be reused); packed: (layout digest, flat buffer(s))
        of an engine whose parameters live in one buffer; tp_shared: a TP engine's
        weight_sync.tp_shared.TPSharedWeights (what its placer last wrote per rank)."""
        from weight_sync.transport import BroadcastTransport

        t0 = time.perf_counter()
        stats = BroadcastTransport(self.group, 0).receive(
            engine.load_weights, version, keeps_views=not direct_load, packed=packed)
        engine.weights_changed()  # in-place buckets bypass load_weights
        if engine.tp_size == 1:
            per_rank = stats.bytes
        elif stats.rank_bytes:  # in place: the buckets each rank's memory took
            per_rank = max(stats.rank_bytes.values())
        else:  # what the placer wrote into each rank's slice
            per_rank = max(tp_shared.written.values())
        report = SyncReport.of(stats, "receive", bytes_per_tp_rank=per_rank,
                               ways={"direct_load": direct_load})
        report.phases = {"receive": time.perf_counter() - t0, **report.phases}
        return report
