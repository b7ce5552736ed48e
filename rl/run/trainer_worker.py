"""A trainer rank: the DeepSpeed policy trainer (and PPO's critic), its updates, checkpoints and
the sending side of a disaggregated weight sync (`TrainerRole`), and the Ray actor that is a
trainer rank alone (`TrainerWorker`)."""
from __future__ import annotations

from rl.observe.timeline import traced
from rl.run.role import OnProcess, Process, Role, holds, lasting
from update.config import LossConfig, TrainerConfig


class TrainerRole(OnProcess):
    """One DeepSpeed rank: the policy trainer (and the critic's, for PPO); a part of a worker
    actor (rl.run.role)."""

    def __init__(self, process: Process):
        self.process = process
        self.trainer = self.critic = None
        self.sender = None  # disaggregated: weight_sync.broadcast.BroadcastSender

    def broadcast_sender(self):
        """This rank's side of a disaggregated sync (made on first use: its shared-memory slots
        and the engines' layout are decided again for each new trainer)."""
        if self.sender is None:
            from weight_sync.broadcast import BroadcastSender

            self.sender = BroadcastSender(self.sync_group)
        return self.sender

    def set_engine_layout(self, encoded: str | None) -> None:
        """The engines' packed layout (by TP rank: weight_sync.in_place.encode_layouts)."""
        self.broadcast_sender().set_engine_layout(encoded)

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        from update.distributed import init_distributed

        init_distributed(self.rank, self.world_size, master_addr, master_port)

    @traced("init trainer")
    def init_trainer(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                     grad_accum: int, temperature: float = 1.0, norm_length: float = 1.0,
                     critic: bool = False, seed: int = 0) -> None:
        """The policy trainer (and the critic's, for PPO); replaces any earlier ones. `seed`:
        what the LoRA adapters are drawn from (PolicyTrainer)."""
        replaces = self.trainer is not None or self.critic is not None
        self.trainer = self.critic = None  # release the previous engines first (warm-up -> RL)
        with lasting(replaces):
            from update.trainer import PolicyTrainer

            self.trainer = PolicyTrainer(model_path, cfg, loss_cfg, grad_accum, temperature,
                                         norm_length, seed)
            if critic:
                from update.critic import ValueTrainer

                self.critic = ValueTrainer(model_path, cfg, loss_cfg, grad_accum)

    def free_models(self) -> None:
        # the sync's shared-memory slots are decided again for the next trainer
        self.trainer = self.critic = self.sender = None

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
    def send_weights(self, version: int, bucket_bytes: int, checksum: str):
        """Disaggregated sync, sending side: every rank helps assemble each bucket (shared
        memory, or a gather), rank 0 broadcasts it; a weight_sync.report.SyncReport."""
        return self.broadcast_sender().send(self.trainer.sync_module(), self.trainer.module.config,
                                            version, bucket_bytes, checksum)

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
        return self.sender.exact_digests(self.trainer.sync_module(), self.trainer.module.config,
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


@holds(trainer_role=TrainerRole)
class TrainerWorker(Role):
    """Disaggregated: a trainer rank alone."""
