"""A colocated worker: one trainer rank and one rollout engine in one process, taking turns on the
same cores or device, synced in process (shared memory, or local buckets) and checked on a probe.

It is both roles by inheriting them, not by holding two parts: Ray makes an actor's remote
methods from its class, so holding a trainer part and an engine part would take one forwarding
method per call (about 25). Each role already holds its engine (`self.trainer`, `self.engine`)
and no flag switches behaviour.
"""
from __future__ import annotations

from rl.observe.timeline import traced
from rl.run.role import phase_seconds
from rl.run.rollout_worker import RolloutRole
from rl.run.trainer_worker import TrainerRole


class ColocatedWorker(TrainerRole, RolloutRole):
    """One trainer rank and one rollout engine in one process, taking turns.

    At rollout.tensor_parallel_size = t > 1 an engine spans t workers: workers [k t, (k+1) t)
    share engine k, which lives in worker k t, its TP rank r bound to the cores of worker
    k t + r. At each sync every trainer rank writes its ZeRO-3 shard of each tensor straight to
    the TP ranks' slices that hold those elements (weight_sync.tp_shared): no gather, no rank
    writes the whole model, and each TP rank receives its slice only.
    """

    # the engines' weights in shared memory, written in place by the trainer ranks
    # (weight_sync.shared_weights, or weight_sync.tp_shared at TP > 1); None: not decided yet,
    # False: not possible here
    shared_weights = None
    tp_size, tp_rank = 1, 0  # the engine's TP size; this worker's TP rank (0: holds the engine)
    tp_rank_bytes = 0  # the most bytes one TP rank received in the last sync

    def init_rollout(self, model_path: str, cfg, seed: int, version: int = 0,
                     env=None, lora_rank: int = 0) -> str | None:
        """As RolloutRole's; None from a worker that holds no engine (TP rank > 0)."""
        self.tp_size = cfg.tensor_parallel_size
        self.tp_rank = self.rank % self.tp_size
        self.shared_weights = None  # a new engine: decided again on the next sync
        if self.tp_rank:
            self.close_engine()
            self.policy_version, self.direct_load = version, True  # writes its rank's slices
            return None
        return super().init_rollout(model_path, cfg, seed, version, env, lora_rank)

    def tp_cores(self, tp_size: int) -> str | None:
        """The cores of workers rank .. rank + tp_size - 1, a TP rank's each ("0|1")."""
        from rl.run.role import cpu_binding

        if self.cpu_cores is None:  # a GPU worker
            return None
        first, count = self.cpu_cores
        runs = [cpu_binding(r, self.world_size, count, first)
                for r in range(self.rank, self.rank + tp_size)]
        return "|".join(a if a == b else f"{a}-{b}" for a, b in (r.split("-") for r in runs))

    def _place_weights_directly(self) -> None:
        if self.engine.tp_size > 1:  # the trainer ranks write the ranks' slices (_share_tp)
            self.direct_load = True
            return
        super()._place_weights_directly()

    def free_models(self) -> None:
        self.shared_weights = None
        super().free_models()

    @traced("sync")
    def sync_weights(self, version: int, bucket_bytes: int, probe: list[int],
                     tolerance: float | None = None, exact: bool = True,
                     adapters: bool = False) -> dict:
        """Make this rank's engine the trainer's weights (collective over the trainer ranks),
        then verify them: byte for byte where the engine holds the shared weights (`exact`),
        and on a probe (tolerance None: the dtypes' uncalibrated default). `adapters`
        (trainer.lora, sync.lora=adapters): the LoRA adapter alone, into the engine's LoRA."""
        import time

        from weight_sync.verify import check_logprobs, probe_tolerance

        if self.engine is not None:
            tolerance = probe_tolerance(self.trainer.cfg.dtype, self.engine.dtype, tolerance)

        t0 = time.perf_counter()
        self.policy_version = None
        if adapters:  # the base never changes: no shared weights, no byte check
            stats, self.shared_weights = self._sync_adapter(version), False
        else:
            if self.shared_weights is None:
                self.shared_weights = self._share_engine_weights()
            if self.tp_size > 1:
                stats = self._write_tp_slices()
            elif self.shared_weights:
                stats = self._write_shared_weights()
            else:
                stats = self._load_buckets(version, bucket_bytes)
        seconds = time.perf_counter() - t0
        with self.spans.span("verification"):
            exact = exact and self.shared_weights and self.tp_size == 1
            checked = self.check_shared_exact() if exact else 0
            t_exact = time.perf_counter() - t0 - seconds
            trainer_lps = self.trainer.sequence_logprobs(probe)
            t1 = time.perf_counter()
            engine_lps = self.engine.prompt_logprobs(probe) if self.engine else None
            t2 = time.perf_counter()
        diff = 0.0 if engine_lps is None else check_logprobs(
            trainer_lps, engine_lps, tolerance, f"rank {self.rank}")
        self.trainer.release_merged()  # LoRA, merged: its copy is not needed until the next sync
        self.policy_version = version
        return {"sync/seconds": seconds, "sync/exact_seconds": t_exact,
                "sync/exact_ranges": float(checked),
                "sync/probe_trainer_seconds": t1 - seconds - t_exact - t0,
                "sync/probe_engine_seconds": t2 - t1, "sync/bytes": stats.bytes,
                "sync/bytes_per_tp_rank": self.tp_rank_bytes if self.tp_size > 1 else stats.bytes,
                "sync/num_buckets": stats.num_buckets, "sync/max_bucket_bytes": stats.max_bucket_bytes,
                "sync/logprob_max_abs_diff": diff, "sync/tolerance": tolerance,
                "sync/direct_load": float(self.direct_load),
                "sync/shared_weights": float(bool(self.shared_weights)), **phase_seconds(stats)}

    def _sync_adapter(self, version: int):
        from weight_sync.buckets import SyncStats

        stats = SyncStats()
        payload = self.adapter_payload("sum64", every_rank=True)  # a collective under ZeRO-3
        if self.engine is not None:
            stats.bytes = self.install_adapter(version, payload)
        return stats

    def check_shared_exact(self) -> int:
        """Whether the engine's parameters hold the bytes of the trainer's, range by range
        (`weight_sync.exact`; collective over the trainer ranks): raises ExactCheckError naming
        the tensors that differ, else returns the number of ranges checked."""
        import torch.distributed as dist

        from weight_sync.exact import compare, engine_digests, trainer_digests

        shared = self.shared_weights
        mine = trainer_digests(shared.layout, shared.spec, self.trainer.sync_module(),
                               shared.rank, shared.world)
        ranges = [None] * shared.world
        dist.all_gather_object(ranges, mine)
        ranges = [r for part in ranges for r in part]
        got = engine_digests(shared.layout, self.engine.parameters(), ranges)
        return compare(ranges, got, f"rank {self.rank}")

    def _share_engine_weights(self):
        """Move the engines' weights into one shared copy when they keep their weights as loaded
        and the trainer is on CPU (every rank decides alike: same config and model)."""
        from weight_sync.resharding import TPSpec
        from weight_sync.shared_weights import SharedWeights

        if self.tp_size > 1:
            return self._share_tp_weights()
        if not self.direct_load or self.device != "cpu":
            return False
        spec = TPSpec.from_hf_config(self.engine.hf_config, tp_size=1)
        shared = SharedWeights.create(self.engine.parameters(), spec)
        if shared is None:
            return False
        self.engine.rebind_parameters(shared.views)
        self._place_weights_directly()  # the placer must write to the shared copy too
        return shared

    def _write_shared_weights(self):
        import time

        from weight_sync.buckets import SyncStats, full_numel, tied_head_alias

        module = self.trainer.sync_module()
        stats = SyncStats()
        t0 = time.perf_counter()
        self.shared_weights.write(module, tied_head_alias(module))
        self.engine.weights_changed()
        stats.add_time("write", time.perf_counter() - t0)
        stats.bytes = sum(full_numel(p) * p.element_size() for p in module.parameters())
        return stats

    def _share_tp_weights(self) -> list:
        """Collective: each TP engine's ranks move their weights into shared memory, and every
        trainer rank maps every engine's ranks (weight_sync.tp_shared): its ZeRO-3 shard is part
        of every engine's model."""
        import torch
        import torch.distributed as dist

        from weight_sync.node_buckets import same_host
        from weight_sync.resharding import TPSpec
        from weight_sync.tp_shared import TPSharedWeights

        if not same_host():
            raise RuntimeError("colocated TP engines need every trainer rank on one host (each "
                               "writes its shard into the engines' shared memory); use "
                               "placement=disaggregated across hosts")
        files = None
        if self.engine is not None:
            spec = TPSpec.from_hf_config(self.engine.hf_config, self.tp_size)
            files = dict(TPSharedWeights.share(self.engine, spec), spec=spec)
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

    def _write_tp_slices(self):
        """Every trainer rank writes its ZeRO-3 shard of each parameter straight into the TP
        ranks' slices of every engine (no gather); the element counts, summed over the ranks,
        must fill every slice; then the engines' ranks re-pack. stats.bytes: what all the TP
        ranks received (tp_rank_bytes: the most one did)."""
        import time

        import torch
        import torch.distributed as dist

        from weight_sync.buckets import SyncStats, tied_head_alias
        from weight_sync.tp_shared import check_filled

        module, stats = self.trainer.sync_module(), SyncStats()
        t0 = time.perf_counter()
        written = self.write_slices(list(module.named_parameters()), tied_head_alias(module))
        counts = torch.tensor([w[t] for w in written for t in range(self.tp_size)],
                              dtype=torch.int64)
        stats.add_time("write", time.perf_counter() - t0)
        dist.all_reduce(counts)  # also the barrier: every rank has written its part
        expected = [shared.expected() for shared in self.shared_weights]
        check_filled(counts.tolist(), [e[t] for e in expected for t in range(self.tp_size)])
        t1 = time.perf_counter()
        if self.engine is not None:
            self.engine.weights_changed()
        stats.add_time("repack", time.perf_counter() - t1)
        itemsize = self.shared_weights[0].itemsize(0)
        stats.bytes = int(counts.sum()) * itemsize
        self.tp_rank_bytes = int(counts.max()) * itemsize
        return stats

    def write_slices(self, params: list, aliases: dict) -> list[dict[int, int]]:
        """This rank's shard of each (HF name, parameter) into every engine's TP ranks; the
        elements written into each, per engine."""
        return [shared.write_shards(params, aliases, self.rank, self.world_size)
                for shared in self.shared_weights]

    def _load_buckets(self, version: int, bucket_bytes: int):
        from weight_sync.transport import LocalTransport

        transport = LocalTransport(bucket_bytes, self.shared_slots, keeps_views=not self.direct_load)
        transport.send(self.trainer.sync_module(), version)
        stats = transport.receive(self.engine.load_weights, version)
        self.shared_slots = transport.shared
        return stats

    def probe(self, probe: list[int]) -> tuple[list[float], list[float] | None]:
        """(trainer, engine) logprobs of the probe, without syncing first (engine None: this
        worker holds no engine, TP rank > 0); collective."""
        return (self.trainer.sequence_logprobs(probe),
                self.engine.prompt_logprobs(probe) if self.engine else None)
