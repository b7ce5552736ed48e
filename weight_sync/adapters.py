"""LoRA adapter syncs (trainer.lora with sync.lora=adapters): the adapter's tensors travel as
one object (megabytes, where the model is gigabytes), with a checksum over their bytes, and
each engine loads them from a directory of PEFT's files in shared memory, one per version."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from weight_sync.checksums import get_checksum


def checksum(tensors: dict[str, torch.Tensor], name: str) -> int:
    """`name` (sync.checksum) over the tensors' bytes in name order (padded to 8 bytes)."""
    parts = [tensors[k].detach().contiguous().cpu().view(-1).view(torch.uint8)
             for k in sorted(tensors)]
    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    pad = -data.numel() % 8
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8)])
    return get_checksum(name)(data)


def adapter_dir(version: int) -> Path:
    """Where this process puts the adapter of `version` (shared memory where there is some)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(root) / f"rlstack-lora-{os.getpid()}" / f"v{version}"
