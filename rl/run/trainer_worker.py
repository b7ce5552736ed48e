"""A trainer rank as a Ray actor: the DeepSpeed policy trainer (and PPO's critic), its updates,
checkpoints and the sending side of a disaggregated weight sync."""
from __future__ import annotations

from rl.observe.timeline import traced
from rl.run.role import Role, phase_seconds
from update.config import LossConfig, TrainerConfig


class TrainerRole(Role):
    """One DeepSpeed rank: the policy trainer (and the critic's, for PPO)."""

    trainer = critic = None
    # disaggregated: the trainer ranks' shared-memory bucket slots (weight_sync.node_buckets),
    # made on the first sync; False when the ranks span several machines, train on GPUs, or
    # /dev/shm is too small (a colocated worker's are its ColocatedSync's)
    shared_slots = None
    engine_layout = None  # the engines' packed layouts by TP rank (weight_sync.in_place), if any

    def set_engine_layout(self, encoded: str | None) -> None:
        """The engines' packed layout (by TP rank: weight_sync.in_place.encode_layouts)."""
        from weight_sync.in_place import decode_layouts

        self.engine_layout = None if encoded is None else decode_layouts(encoded)

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        from update.distributed import init_distributed

        init_distributed(self.rank, self.world_size, master_addr, master_port)

    @traced("init trainer")
    def init_trainer(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                     grad_accum: int, temperature: float = 1.0, norm_length: float = 1.0,
                     critic: bool = False, seed: int = 0) -> None:
        """The policy trainer (and the critic's, for PPO); replaces any earlier ones. `seed`:
        what the LoRA adapters are drawn from (PolicyTrainer)."""
        from update.trainer import PolicyTrainer

        self.trainer = self.critic = None  # release the previous engines first (warm-up -> RL)
        self.trainer = PolicyTrainer(model_path, cfg, loss_cfg, grad_accum, temperature,
                                     norm_length, seed)
        if critic:
            from update.critic import ValueTrainer

            self.critic = ValueTrainer(model_path, cfg, loss_cfg, grad_accum)

    def free_models(self) -> None:
        # the shared-memory slots are decided again for the next trainer
        self.trainer = self.critic = self.shared_slots = self.engine_layout = None
        super().free_models()

    @traced("prepare")
    def prepare(self, micro_batches: list[dict]) -> list[dict]:
        """Old (and reference) logprobs, and critic values, of each micro-batch."""
        out = self.trainer.prepare(micro_batches)
        if self.critic is not None:
            for item, values in zip(out, self.critic.prepare(micro_batches)):
                item.update(values)
        return out

    @traced("update")
    def train(self, micro_batches: list[dict], counts) -> dict:
        """One optimizer step; metrics are this rank's shares (summed over the ranks), also
        its process's peak resident memory so far (colocated: with its engine)."""
        import resource

        metrics = self.trainer.train_step(micro_batches, counts)
        if self.critic is not None:
            metrics.update(self.critic.train_step(micro_batches, counts))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        metrics["memory/trainer_peak_rss_mib"] = peak / 1024
        return metrics

    @traced("warm-up")
    def sft(self, micro_batches: list[dict], num_tokens: float) -> dict:
        return self.trainer.sft_step(micro_batches, num_tokens)

    @traced("verification")
    def trainer_logprobs(self, token_ids: list[int]) -> list[float]:
        """The trainer's logprobs of a probe (a collective under ZeRO-3: every rank calls)."""
        return self.trainer.sequence_logprobs(token_ids)

    @traced("sync")
    def send_weights(self, version: int, bucket_bytes: int, checksum: str) -> dict:
        """Disaggregated sync, sending side: every rank helps assemble each bucket (shared
        memory, or a gather), rank 0 broadcasts it."""
        import time

        from weight_sync.transport import BroadcastTransport

        t0 = time.perf_counter()
        engine = None
        if self.engine_layout is not None:
            from weight_sync.resharding import TPSpec

            engine = (self.engine_layout, TPSpec.from_hf_config(self.trainer.module.config,
                                                                len(self.engine_layout)))
        transport = BroadcastTransport(self.sync_group, bucket_bytes, checksum, self.shared_slots,
                                       engine)
        stats = transport.send(self.trainer.sync_module(), version)
        self.shared_slots = transport.shared
        return {"sync/send_seconds": time.perf_counter() - t0, "sync/bytes": stats.bytes,
                "sync/num_buckets": stats.num_buckets,
                "sync/max_bucket_bytes": stats.max_bucket_bytes,
                "sync/in_place": float(transport.in_place), **phase_seconds(stats, "send_")}

    @traced("sync")
    def adapter_payload(self, checksum_name: str, every_rank: bool = False) -> dict | None:
        """Adapter sync, sending side (a collective under ZeRO-3: every rank calls): the LoRA
        adapter's tensors, its adapter_config.json and their checksum, on rank 0 (None on the
        others unless `every_rank`)."""
        from update.lora import adapter_config
        from weight_sync.adapters import checksum

        tensors = self.trainer.adapter_weights()
        if self.rank and not every_rank:
            return None
        tensors = {k: v.clone() for k, v in tensors.items()}  # not views of a gather buffer
        return {"tensors": tensors, "checksum_name": checksum_name,
                "checksum": checksum(tensors, checksum_name),
                "config": adapter_config(self.trainer.cfg.lora, self.trainer.model_path)}

    @traced("verification")
    def exact_digests(self) -> list:
        """Disaggregated, in place: this rank's `weight_sync.exact` digests of what the last
        sync sent, for the engines to check their parameters against."""
        from weight_sync.exact import trainer_digests
        from weight_sync.resharding import TPSpec

        spec = TPSpec.from_hf_config(self.trainer.module.config, 1)
        # (TP 1: the placement skips it at TP > 1)
        return trainer_digests(self.engine_layout[0], spec, self.trainer.sync_module(),
                               self.rank, self.world_size)

    @traced("checkpoint")
    def save_checkpoint(self, directory: str) -> None:
        """This rank's shards of the policy (and critic) engines into directory/policy|critic."""
        self.trainer.save_checkpoint(directory, "policy")
        if self.critic is not None:
            self.critic.save_checkpoint(directory, "critic")

    @traced("load checkpoint")
    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory, "policy")
        if self.critic is not None:
            self.critic.load_checkpoint(directory, "critic")

    @traced("save")
    def save_hf(self, directory: str) -> None:
        self.trainer.save_hf(directory)


class TrainerWorker(TrainerRole):
    """Disaggregated: a trainer rank alone."""
