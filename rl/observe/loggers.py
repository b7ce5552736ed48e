"""Metric sinks besides metrics.jsonl: TensorBoard event files and Weights & Biases.

Each takes the run's resolved config once (TensorBoard as hparams, W&B as the run config) and
every step's metrics with the step number, so a resumed run that starts at step k writes from
k on (TensorBoard purges events at or after k; W&B resumes the run's id).
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path


def flat_config(tree: dict, prefix: str = "") -> dict:
    """{"trainer.lr": 1e-5, ...}: scalars as they are, lists and dicts as text."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flat_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def numeric(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class TensorBoardLogger:
    """<run>/tensorboard: one scalar series per metric; the config under HPARAMS and as text."""

    def __init__(self, run_dir: Path, config: dict, start_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=start_step if start_step > 1 else None)
        flat = flat_config(config)
        # written into this run's own event file (add_hparams would open a sub-run); the
        # session's end is written when the run closes. A resumed run has them already, and
        # a step-0 event after the purge would make readers drop the steps before it too
        experiment, start, self.end = hparams(flat, {"reward/mean": 0.0})
        self.last_step = max(0, start_step - 1)
        if start_step <= 1:
            for summary in (experiment, start):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flat.items()))

    def log(self, metrics: dict, step: int) -> None:
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        self.last_step = step

    def close(self) -> None:
        # at the last step: an event at an earlier step makes readers purge the later ones
        self.writer.file_writer.add_summary(self.end, global_step=self.last_step)
        self.writer.close()


class WandbLogger:
    """A W&B run in <run>/wandb: offline (synced later with `wandb sync`) unless
    WANDB_API_KEY is set or WANDB_MODE says otherwise."""

    def __init__(self, run_dir: Path, config: dict, project: str, start_step: int = 1):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY")
                                                else "offline")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        # steps this run id surely has: written when a logger closes (W&B has flushed then). A
        # restarted placement recomputes them bit for bit, so they are not written again. A
        # killed process writes nothing here, and its service may not have flushed its last
        # records: the resumed run writes from its checkpoint on
        self.last_file = run_dir / "wandb_last_step"
        self.skip_until = int(self.last_file.read_text()) if self.last_file.exists() else 0
        self.last_step = self.skip_until
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, dir=str(run_dir),
                              config=config, mode=mode, resume="allow",
                              settings=wandb.Settings(console="off", x_disable_stats=True,
                                                      silent=True))
        self.mode = mode

    def log(self, metrics: dict, step: int) -> None:
        if step <= self.skip_until:
            return
        self.run.log(numeric(metrics), step=step)
        self.last_step = step

    def close(self) -> None:
        self.run.finish()
        self.last_file.write_text(str(self.last_step))


def open_loggers(names: list[str], run_dir: Path, config: dict, project: str,
                 start_step: int = 1) -> list:
    """The sinks `run.loggers` names besides jsonl (RunLog writes that one itself)."""
    out = []
    if "tensorboard" in names:
        out.append(TensorBoardLogger(run_dir, config, start_step))
    if "wandb" in names:
        out.append(WandbLogger(run_dir, config, project, start_step))
    return out
