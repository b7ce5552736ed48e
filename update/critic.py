"""PPO's critic: a value head on the policy's architecture, trained on its own DeepSpeed engine.

Its weights never go to the rollout engine. It scores a micro-batch as the policy does
(update.forward.response_parts, in either layout): the value head is a one-entry vocabulary.
"""
from __future__ import annotations

import torch

from update.config import LossConfig, TrainerConfig
from update.forward import full_layout, shares_prompts
from update.losses import BatchCounts, value_loss
from update.mlp import lean_gated_mlps
from update.zero import load_engine, save_engine, scoring, zero_engine


class ValueModel(torch.nn.Module):
    """The transformer body of a causal LM + a linear head: hidden state -> scalar value."""

    def __init__(self, model_path: str):
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(model_path, dtype=torch.float32)
        lean_gated_mlps(self.backbone)
        self.value_head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)  # start at V = 0 (as OpenRLHF's critic)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids=None, past_key_values=None,
                use_cache=False, logits_to_keep=0):
        """A causal LM's call and output: `.logits` [B, T, 1] the values of the last
        logits_to_keep positions (0: all), or of those it indexes (a tensor, as
        update.forward.kept_positions passes)."""
        from transformers.modeling_outputs import CausalLMOutput

        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, past_key_values=past_key_values,
                               use_cache=use_cache).last_hidden_state
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutput(logits=self.value_head(hidden[:, kept].float()))

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.backbone.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        return self.backbone.device


def _values_of(parts: list[torch.Tensor]) -> torch.Tensor:
    """[B, R] values from response_parts' [B, r, 1] pieces."""
    return torch.cat([part[..., 0] for part in parts], 1)


class ValueTrainer:
    def __init__(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig, grad_accum: int):
        import torch.distributed as dist

        self.loss_cfg, self.grad_accum = loss_cfg, grad_accum
        self.world_size = dist.get_world_size()
        model = ValueModel(model_path)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.critic_lr,
                                      betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        self.engine = zero_engine(model, cfg, self.world_size, grad_accum, optimizer)
        self.share_prompts = shares_prompts(cfg, model.backbone.config, recompute=False)

    def save_checkpoint(self, directory: str, tag: str) -> None:
        save_engine(self.engine, directory, tag)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        load_engine(self.engine, directory, tag)

    def _values(self, mb: dict, model=None) -> torch.Tensor:
        """V at position t estimates the return of the tokens after t: [B, R], like logprobs
        (position P - 1, the prompt's last, values the first response token). `model`: the
        engine (default), or what `scoring` gives."""
        if not self.share_prompts:
            mb = full_layout(mb)
        return (model or self.engine)(mb=mb, score=_values_of)

    @torch.no_grad()
    def prepare(self, micro_batches: list[dict]) -> list[dict]:
        self.engine.eval()
        with scoring(self.engine) as critic:  # outside the record of ZeRO-3's training steps
            return [{"values": self._values(mb, critic).cpu()} for mb in micro_batches]

    def train_step(self, micro_batches: list[dict], counts: BatchCounts) -> dict:
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"critic: got {len(micro_batches)} micro-batches for "
                             f"{self.grad_accum} accumulation steps")
        self.engine.train()
        sums: dict[str, float] = {}
        for mb in micro_batches:
            dev = self.engine.device
            loss, metrics = value_loss(self._values(mb), mb["values"].to(dev),
                                       mb["returns"].to(dev), mb["response_mask"].to(dev),
                                       self.loss_cfg.value_clip, counts)
            self.engine.backward(loss * self.world_size * self.grad_accum)
            self.engine.step()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return sums
