"""`reward_model`: a local `transformers` sequence-classification model scoring
prompt + completion, batched. The controller runs it in its own Ray actor."""
from __future__ import annotations

from pathlib import Path


class RewardModelScorer:
    """A single-logit model's logit, or a multi-label model's probability of its last label."""

    def __init__(self, path: str, batch_size: int = 16, max_length: int = 1024):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(path) / "config.json").exists():
            raise FileNotFoundError(f"reward_model path '{path}' is not a Hugging Face model "
                                    f"directory (no config.json); set the term's args.path")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path,
                                                                        dtype=torch.float32)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()
        self.batch_size, self.max_length = batch_size, max_length

    def ready(self) -> bool:
        return True

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        import torch

        out: list[float] = []
        for i in range(0, len(prompts), self.batch_size):
            texts = [p + c for p, c in zip(prompts[i:i + self.batch_size],
                                           completions[i:i + self.batch_size])]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_length)
            with torch.no_grad():
                logits = self.model(**enc).logits.float()
            values = logits[:, 0] if logits.shape[-1] == 1 else logits.softmax(-1)[:, -1]
            out += values.tolist()
        return out
