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
    """One trainer rank and one rollout engine in one process, taking turns."""

    # the engines' weights in shared memory, written in place by the trainer ranks
    # (weight_sync.shared_weights); None: not decided yet, False: not possible here
    shared_weights = None

    def init_rollout(self, *args, **kwargs) -> str:
        mode = super().init_rollout(*args, **kwargs)
        self.shared_weights = None  # a new engine: decided again on the next sync
        return mode

    def free_models(self) -> None:
        self.shared_weights = None
        super().free_models()

    @traced("sync")
    def sync_weights(self, version: int, bucket_bytes: int, probe: list[int],
                     tolerance: float | None = None, exact: bool = True) -> dict:
        """Make this rank's engine the trainer's weights (collective over the trainer ranks),
        then verify them: byte for byte where the engine holds the shared weights (`exact`),
        and on a probe (tolerance None: the dtypes' uncalibrated default)."""
        import time

        from weight_sync.verify import check_logprobs, probe_tolerance

        tolerance = probe_tolerance(self.trainer.cfg.dtype, self.engine.dtype, tolerance)

        t0 = time.perf_counter()
        self.policy_version = None
        if self.shared_weights is None:
            self.shared_weights = self._share_engine_weights()
        if self.shared_weights:
            stats = self._write_shared_weights()
        else:
            stats = self._load_buckets(version, bucket_bytes)
        seconds = time.perf_counter() - t0
        with self.spans.span("verification"):
            checked = self.check_shared_exact() if exact and self.shared_weights else 0
            t_exact = time.perf_counter() - t0 - seconds
            trainer_lps = self.trainer.sequence_logprobs(probe)
            t1 = time.perf_counter()
            engine_lps = self.engine.prompt_logprobs(probe)
            t2 = time.perf_counter()
        diff = check_logprobs(trainer_lps, engine_lps, tolerance, f"rank {self.rank}")
        self.policy_version = version
        return {"sync/seconds": seconds, "sync/exact_seconds": t_exact,
                "sync/exact_ranges": float(checked),
                "sync/probe_trainer_seconds": t1 - seconds - t_exact - t0,
                "sync/probe_engine_seconds": t2 - t1, "sync/bytes": stats.bytes,
                "sync/num_buckets": stats.num_buckets, "sync/max_bucket_bytes": stats.max_bucket_bytes,
                "sync/logprob_max_abs_diff": diff, "sync/tolerance": tolerance,
                "sync/direct_load": float(self.direct_load),
                "sync/shared_weights": float(bool(self.shared_weights)), **phase_seconds(stats)}

    def check_shared_exact(self) -> int:
        """Whether the engine's parameters hold the bytes of the trainer's, range by range
        (`weight_sync.exact`; collective over the trainer ranks): raises ExactCheckError naming
        the tensors that differ, else returns the number of ranges checked."""
        import torch.distributed as dist

        from weight_sync.exact import compare, engine_digests, trainer_digests

        shared = self.shared_weights
        mine = trainer_digests(shared.layout, shared.spec, self.trainer.module, shared.rank,
                               shared.world)
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

        module = self.trainer.module
        stats = SyncStats()
        t0 = time.perf_counter()
        self.shared_weights.write(module, tied_head_alias(module))
        self.engine.weights_changed()
        stats.add_time("write", time.perf_counter() - t0)
        stats.bytes = sum(full_numel(p) * p.element_size() for p in module.parameters())
        return stats

    def _load_buckets(self, version: int, bucket_bytes: int):
        from weight_sync.transport import LocalTransport

        transport = LocalTransport(bucket_bytes, self.shared_slots, keeps_views=not self.direct_load)
        transport.send(self.trainer.module, version)
        stats = transport.receive(self.engine.load_weights, version)
        self.shared_slots = transport.shared
        return stats

    def probe(self, probe: list[int]) -> tuple[list[float], list[float]]:
        """(trainer, engine) logprobs of the probe, without syncing first (for tests)."""
        return self.trainer.sequence_logprobs(probe), self.engine.prompt_logprobs(probe)
