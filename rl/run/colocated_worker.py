"""A colocated worker: one trainer rank and one rollout engine in one process, taking turns on the
same cores or device, synced in process (weight_sync.colocated: shared memory, or local
buckets) and checked on a probe.

The actor holds its two roles as parts (`trainer_role`, `rollout_role`) and forwards their
methods (rl.run.role.holds); its own methods are the ones that need both: the engine's
start beside its TP peers, the sync and the probe.
"""
from __future__ import annotations

from rl.observe.timeline import traced
from rl.run.role import Role, cpu_binding, holds
from rl.run.rollout_worker import RolloutRole
from rl.run.trainer_worker import TrainerRole


class ColocatedEngine(RolloutRole):
    """The engine part of a colocated worker. At TP > 1 its TP ranks run on the cores of the
    workers it spans, and the trainer ranks write its ranks' slices (weight_sync.colocated)."""

    def tp_cores(self, tp_size: int) -> str | None:
        """The cores of workers rank .. rank + tp_size - 1, a TP rank's each ("0|1")."""
        if self.cpu_cores is None:  # a GPU worker
            return None
        first, count = self.cpu_cores
        runs = [cpu_binding(r, self.world_size, count, first)
                for r in range(self.rank, self.rank + tp_size)]
        return "|".join(a if a == b else f"{a}-{b}" for a, b in (r.split("-") for r in runs))

    def place_weights_directly(self) -> None:
        if self.engine.tp_size > 1:  # the trainer ranks write the ranks' slices (ColocatedSync)
            self.direct_load = True
            return
        super().place_weights_directly()

    def without_engine(self, version: int) -> None:
        """A worker at TP rank > 0 holds no engine: its trainer rank writes its share of every
        TP rank's slices of policy `version` (and later ones) at each sync."""
        self.close_engine()
        self.policy_version, self.direct_load = version, True


@holds(trainer_role=TrainerRole, rollout_role=ColocatedEngine)
class ColocatedWorker(Role):
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
            self.rollout_role.without_engine(version)
            return None
        return self.rollout_role.init_rollout(model_path, cfg, seed, version, env, lora_rank)

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

        trainer, rollout = self.trainer_role.trainer, self.rollout_role
        engine = rollout.engine  # None at TP rank > 0
        if engine is not None:
            tolerance = probe_tolerance(trainer.cfg.dtype, engine.dtype, tolerance)
        sync = self.colocated_sync
        t0 = time.perf_counter()
        rollout.policy_version = None
        if adapters:  # the base never changes: no shared weights, no byte check
            payload = self.trainer_role.adapter_payload("sum64", every_rank=True)  # collective
            report = sync.adapters_only(
                rollout.install_adapter(version, payload) if engine is not None else 0)
        else:
            if sync.shared is None and sync.share(engine,
                                                  rollout.direct_load and self.device == "cpu"):
                rollout.place_weights_directly()  # the placer must write to the shared copy too
            report = sync.run(trainer.sync_module(), engine, version, bucket_bytes,
                              keeps_views=not rollout.direct_load)
        report.seconds = time.perf_counter() - t0
        report.ways = {"direct_load": rollout.direct_load, "shared_weights": bool(sync.shared)}
        with self.spans.span("verification"):
            sync.verify(report, trainer, engine, probe, tolerance, exact, f"rank {self.rank}")
        trainer.release_merged()  # LoRA, merged: its copy is not needed until the next sync
        rollout.policy_version = version
        return report

    def check_shared_exact(self) -> int:
        """Whether the engine's parameters hold the bytes of the trainer's (collective over the
        trainer ranks): raises ExactCheckError naming the tensors that differ, else returns the
        number of ranges checked."""
        return self.colocated_sync.check_exact(self.trainer_role.trainer.sync_module(),
                                               self.rollout_role.engine, f"rank {self.rank}")

    def probe(self, probe: list[int]) -> tuple[list[float], list[float] | None]:
        """(trainer, engine) logprobs of the probe, without syncing first (engine None: this
        worker holds no engine, TP rank > 0); collective."""
        engine = self.rollout_role.engine
        return (self.trainer_role.trainer.sequence_logprobs(probe),
                engine.prompt_logprobs(probe) if engine else None)
