"""The colocated sync: a trainer rank and an engine in one process (a colocated worker), every
trainer rank taking part. Which way the weights go is decided once per engine (`share`):

- shared weights (CPU, an engine that keeps its weights as loaded, TP 1): the engines' weights
  move into one shared-memory copy (weight_sync.shared_weights) that every trainer rank writes
  its ZeRO-3 shard into, in place; the engine then re-packs;
- TP > 1: each TP engine's ranks share their slices (weight_sync.tp_shared), and every trainer
  rank writes its shard of each tensor straight into the slices that hold those elements, of
  every engine: no gather, and each TP rank receives its slice only;
- otherwise local buckets (weight_sync.transport.LocalTransport): the trainer ranks assemble
  each bucket (shared memory on one host, else a DeepSpeed gather) and the engine loads it.

It knows the two sides through small interfaces: the trainer's model to send (an nn.Module,
ZeRO-3 sharded or not) and the engine's (`parameters`, `hf_config`, `rebind_parameters`,
`weights_changed`, `load_weights`; None in a worker that holds no engine, a TP rank > 0).
"""
from __future__ import annotations

import time

import torch

from weight_sync.buckets import SyncStats, full_numel, tied_head_alias
from weight_sync.report import SyncReport


class ColocatedSync:
    """The sync state of one colocated worker's trainer rank `rank` of `world`, beside an engine
    of `tp_size` TP ranks (this worker's, or another worker's at TP rank > 0)."""

    def __init__(self, rank: int, world: int, tp_size: int):
        self.rank, self.world, self.tp_size = rank, world, tp_size
        # the engines' weights in shared memory: a SharedWeights (TP 1) or a TPSharedWeights
        # per engine (TP > 1); None: not decided yet, False: not possible here
        self.shared = None
        self.slots = None  # the local buckets' shared-memory slots (weight_sync.node_buckets)
        self.tp_rank_bytes = 0  # the most bytes one TP rank received in the last sync

    def share(self, engine, keeps_weights: bool) -> bool:
        """Decide the way for this engine (collective: every rank decides alike, from the same
        config and model); keeps_weights: the engine keeps its weights as loaded on CPU (it
        copies syncs in). True when the engine's parameters moved into shared memory at TP 1:
        the caller then points its copying at them."""
        if self.tp_size > 1:
            self.shared = self._share_tp(engine)
            return False
        self.shared = False
        if keeps_weights:
            from weight_sync.resharding import TPSpec
            from weight_sync.shared_weights import SharedWeights

            spec = TPSpec.from_hf_config(engine.hf_config, tp_size=1)
            shared = SharedWeights.create(engine.parameters(), spec)
            if shared is not None:
                engine.rebind_parameters(shared.views)
                self.shared = shared
        return bool(self.shared)

    def adapters_only(self, nbytes: int) -> SyncReport:
        """LoRA adapter syncs (sync.lora=adapters): the base never changes, so nothing is shared
        and nothing byte-checked; the adapter (`nbytes`) went its own way
        (weight_sync.adapters)."""
        self.shared = False
        return self._report(SyncStats(bytes=nbytes))

    def run(self, module: torch.nn.Module, engine, version: int, bucket_bytes: int,
            keeps_views: bool) -> SyncReport:
        """Make the engine(s) hold `module`'s weights, the way `share` chose (collective over
        the trainer ranks); keeps_views: local buckets' tensors may be kept by the engine."""
        if self.tp_size > 1:
            return self._report(self._write_tp_slices(module, engine))
        if self.shared:
            stats = SyncStats()
            t0 = time.perf_counter()
            self.shared.write(module, tied_head_alias(module))
            engine.weights_changed()
            stats.add_time("write", time.perf_counter() - t0)
            stats.bytes = sum(full_numel(p) * p.element_size() for p in module.parameters())
            return self._report(stats)
        from weight_sync.transport import LocalTransport

        transport = LocalTransport(bucket_bytes, self.slots, keeps_views=keeps_views)
        transport.send(module, version)
        stats = transport.receive(engine.load_weights, version)
        self.slots = transport.shared
        return self._report(stats)

    def _report(self, stats: SyncStats) -> SyncReport:
        return SyncReport.of(stats, bytes_per_tp_rank=self.tp_rank_bytes if self.tp_size > 1
                             else stats.bytes)

    def verify(self, report: SyncReport, trainer, engine, probe: list[int], tolerance: float,
               exact: bool, where: str) -> None:
        """After `run`: the engine's parameters byte for byte against the trainer's (`exact`,
        where they are the shared weights at TP 1), then the probe's logprobs, trainer's
        (`sequence_logprobs`, a collective under ZeRO-3) against the engine's
        (`prompt_logprobs`; no engine: nothing to compare); raises ExactCheckError or
        WeightSyncError, else adds both checks to `report`."""
        from weight_sync.verify import check_logprobs

        t0 = time.perf_counter()
        checked = (self.check_exact(trainer.sync_module(), engine, where)
                   if exact and self.shared and self.tp_size == 1 else 0)
        t1 = time.perf_counter()
        report.exact(t1 - t0, checked)
        trainer_lps = trainer.sequence_logprobs(probe)
        t2 = time.perf_counter()
        engine_lps = engine.prompt_logprobs(probe) if engine is not None else None
        report.phases.update(probe_trainer=t2 - t1, probe_engine=time.perf_counter() - t2)
        report.probe(0.0 if engine_lps is None else
                     check_logprobs(trainer_lps, engine_lps, tolerance, where), tolerance)

    def check_exact(self, module: torch.nn.Module, engine, where: str) -> int:
        """Whether the engine's parameters hold the bytes of `module`'s, range by range
        (`weight_sync.exact`; collective over the trainer ranks; shared weights at TP 1 only):
        raises ExactCheckError naming the tensors that differ, else returns the number of
        ranges checked."""
        import torch.distributed as dist

        from weight_sync.exact import compare, engine_digests, trainer_digests

        shared = self.shared
        mine = trainer_digests(shared.layout, shared.spec, module, shared.rank, shared.world)
        ranges = [None] * shared.world
        dist.all_gather_object(ranges, mine)
        ranges = [r for part in ranges for r in part]
        return compare(ranges, engine_digests(shared.layout, engine.parameters(), ranges), where)

    def _share_tp(self, engine) -> list:
        """Collective: each TP engine's ranks move their weights into shared memory, and every
        trainer rank maps every engine's ranks (weight_sync.tp_shared): its ZeRO-3 shard is part
        of every engine's model."""
        import torch.distributed as dist

        from weight_sync.node_buckets import same_host
        from weight_sync.resharding import TPSpec
        from weight_sync.tp_shared import TPSharedWeights

        if not same_host():
            raise RuntimeError("colocated TP engines need every trainer rank on one host (each "
                               "writes its shard into the engines' shared memory); use "
                               "placement=disaggregated across hosts")
        files = None
        if engine is not None:
            spec = TPSpec.from_hf_config(engine.hf_config, self.tp_size)
            files = dict(TPSharedWeights.share(engine, spec), spec=spec)
        shared, error = [], None
        try:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, files)
            try:
                shared = [TPSharedWeights.open(f["spec"], f) for f in everyone if f is not None]
            except OSError as e:
                error = e
            mapped = torch.tensor([int(error is None)])
            dist.all_reduce(mapped, op=dist.ReduceOp.MIN)  # also: every writer opened the files
        finally:  # the memory lives while mapped; a failed peer must not leave the files
            if files is not None:
                TPSharedWeights.unlink(files)
        if not int(mapped):
            raise RuntimeError(f"could not map the TP engines' weights in every trainer rank "
                               f"({error or 'another rank failed'}); give the container a "
                               f"larger /dev/shm, or use placement=disaggregated")
        return shared

    def _write_tp_slices(self, module: torch.nn.Module, engine) -> SyncStats:
        """Every trainer rank writes its ZeRO-3 shard of each parameter straight into the TP
        ranks' slices of every engine (no gather); the element counts, summed over the ranks,
        must fill every slice; then the engines' ranks re-pack. stats.bytes: what all the TP
        ranks received (tp_rank_bytes: the most one did)."""
        import torch.distributed as dist

        from weight_sync.tp_shared import check_filled

        stats = SyncStats()
        t0 = time.perf_counter()
        written = self.write_slices(list(module.named_parameters()), tied_head_alias(module))
        counts = torch.tensor([w[t] for w in written for t in range(self.tp_size)],
                              dtype=torch.int64)
        stats.add_time("write", time.perf_counter() - t0)
        dist.all_reduce(counts)  # also the barrier: every rank has written its part
        expected = [shared.expected() for shared in self.shared]
        check_filled(counts.tolist(), [e[t] for e in expected for t in range(self.tp_size)])
        t1 = time.perf_counter()
        if engine is not None:
            engine.weights_changed()
        stats.add_time("repack", time.perf_counter() - t1)
        itemsize = self.shared[0].itemsize(0)
        stats.bytes = int(counts.sum()) * itemsize
        self.tp_rank_bytes = int(counts.max()) * itemsize
        return stats

    def write_slices(self, params: list, aliases: dict) -> list[dict[int, int]]:
        """This rank's shard of each (HF name, parameter) into every engine's TP ranks; the
        elements written into each, per engine."""
        return [shared.write_shards(params, aliases, self.rank, self.world)
                for shared in self.shared]
