"""A colocated worker: one trainer rank and one rollout engine in one process, taking turns on the
same cores or device, synced in process (weight_sync.colocated: shared memory, or local
buckets) and checked on a probe.

It is both roles by inheriting them, not by holding two parts: Ray makes an actor's remote
methods from its class, so holding a trainer part and an engine part would take one forwarding
method per call (about 25). Each role already holds its engine (`self.trainer`, `self.engine`)
and no flag switches behaviour.
"""
from __future__ import annotations

from rl.observe.timeline import traced
from rl.run.rollout_worker import RolloutRole
from rl.run.trainer_worker import TrainerRole


class ColocatedWorker(TrainerRole, RolloutRole):
    """One trainer rank and one rollout engine in one process, taking turns.

    At rollout.tensor_parallel_size = t > 1 an engine spans t workers: workers [k t, (k+1) t)
    share engine k, which lives in worker k t, its TP rank r bound to the cores of worker
    k t + r. At each sync every trainer rank writes its ZeRO-3 shard of each tensor straight to
    the TP ranks' slices that hold those elements (weight_sync.colocated): no gather, no rank
    writes the whole model, and each TP rank receives its slice only.
    """

    colocated_sync = None  # weight_sync.colocated.ColocatedSync, made with each engine
    tp_size, tp_rank = 1, 0  # the engine's TP size; this worker's TP rank (0: holds the engine)

    def init_rollout(self, model_path: str, cfg, seed: int, version: int = 0,
                     env=None, lora_rank: int = 0) -> str | None:
        """As RolloutRole's; None from a worker that holds no engine (TP rank > 0)."""
        from weight_sync.colocated import ColocatedSync

        self.tp_size = cfg.tensor_parallel_size
        self.tp_rank = self.rank % self.tp_size
        # a new engine: the sync's way is decided again on the next sync
        self.colocated_sync = ColocatedSync(self.rank, self.world_size, self.tp_size)
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
        if self.engine.tp_size > 1:  # the trainer ranks write the ranks' slices (ColocatedSync)
            self.direct_load = True
            return
        super()._place_weights_directly()

    def free_models(self) -> None:
        self.colocated_sync = None
        super().free_models()

    @traced("sync")
    def sync_weights(self, version: int, bucket_bytes: int, probe: list[int],
                     tolerance: float | None = None, exact: bool = True,
                     adapters: bool = False):
        """Make this rank's engine the trainer's weights (collective over the trainer ranks:
        weight_sync.colocated), then verify them: byte for byte where the engine holds the
        shared weights (`exact`), and on a probe (tolerance None: the dtypes' uncalibrated
        default). `adapters` (trainer.lora, sync.lora=adapters): the LoRA adapter alone, into
        the engine's LoRA. Returns this rank's weight_sync.report.SyncReport."""
        import time

        from weight_sync.verify import probe_tolerance

        if self.engine is not None:
            tolerance = probe_tolerance(self.trainer.cfg.dtype, self.engine.dtype, tolerance)
        sync = self.colocated_sync
        t0 = time.perf_counter()
        self.policy_version = None
        if adapters:  # the base never changes: no shared weights, no byte check
            payload = self.adapter_payload("sum64", every_rank=True)  # collective (ZeRO-3)
            report = sync.adapters_only(
                self.install_adapter(version, payload) if self.engine is not None else 0)
        else:
            if sync.shared is None and sync.share(
                    self.engine, self.direct_load and self.device == "cpu"):
                self._place_weights_directly()  # the placer must write to the shared copy too
            report = sync.run(self.trainer.sync_module(), self.engine, version, bucket_bytes,
                              keeps_views=not self.direct_load)
        report.seconds = time.perf_counter() - t0
        report.ways = {"direct_load": self.direct_load, "shared_weights": bool(sync.shared)}
        with self.spans.span("verification"):
            sync.verify(report, self.trainer, self.engine, probe, tolerance, exact,
                        f"rank {self.rank}")
        self.trainer.release_merged()  # LoRA, merged: its copy is not needed until the next sync
        self.policy_version = version
        return report

    def check_shared_exact(self) -> int:
        """Whether the engine's parameters hold the bytes of the trainer's (collective over the
        trainer ranks): raises ExactCheckError naming the tensors that differ, else returns the
        number of ranges checked."""
        return self.colocated_sync.check_exact(self.trainer.sync_module(), self.engine,
                                               f"rank {self.rank}")

    def probe(self, probe: list[int]) -> tuple[list[float], list[float] | None]:
        """(trainer, engine) logprobs of the probe, without syncing first (engine None: this
        worker holds no engine, TP rank > 0); collective."""
        return (self.trainer.sequence_logprobs(probe),
                self.engine.prompt_logprobs(probe) if self.engine else None)
