"""Metric sinks besides metrics.jsonl: TensorBoard event files and Weights & Biases.

Each takes the run's resolved config once (TensorBoard as hparams, W&B as the run config) and
every step's metrics with the step number, so a resumed run that starts at step k writes from
k on (TensorBoard purges events at or after k; W&B resumes the run's id and first logs the
steps of metrics.jsonl that a killed process's W&B service never wrote).
"""
from __future__ import annotations

import json
import os
import struct
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

    def catch_up(self, lines: list[dict]) -> None:
        """Nothing to do: each step's events were flushed to the file when logged, which a
        killed process does not lose."""

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
    WANDB_API_KEY is set or WANDB_MODE says otherwise.

    W&B takes each step once, in increasing order. A process killed with SIGKILL loses the
    records its W&B service had not written yet; the run that resumes from a checkpoint logs
    them from metrics.jsonl (`catch_up`) before its own steps, and never a step W&B holds."""

    def __init__(self, run_dir: Path, config: dict, project: str, start_step: int = 1):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY")
                                                else "offline")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        # the steps W&B holds: offline, those in the run's earlier files (a restarted placement
        # recomputes them bit for bit, a resumed async run differently: W&B keeps the first);
        # online, those before the step the resumed run starts at
        held = max((row["_step"] for row in wandb_offline_history(run_dir) if "_step" in row),
                   default=-1)
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, dir=str(run_dir),
                              config=config, mode=mode, resume="allow",
                              settings=wandb.Settings(console="off", x_disable_stats=True,
                                                      silent=True))
        self.held = max(held, self.run.starting_step - 1) if mode == "online" else held
        self.mode = mode

    def catch_up(self, lines: list[dict]) -> None:
        """Log the lines (metrics.jsonl's, up to the checkpoint a run resumes from) that W&B
        does not hold."""
        for m in lines:
            self.log(m, m["step"])

    def log(self, metrics: dict, step: int) -> None:
        if step <= self.held:
            return
        self.run.log(numeric(metrics), step=step)
        self.held = step

    def close(self) -> None:
        self.run.finish()


def wandb_offline_history(run_dir: Path) -> list[dict]:
    """The history rows of a run's offline W&B files, in the order written (each process that
    ran it wrote a file). A file is a LevelDB-style log of protobuf records (32 KiB blocks of
    checksum, length, type, payload); a record torn by a kill is skipped."""
    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        rows += _wandb_file_history(path)
    return rows


def _wandb_records(data: bytes) -> list[bytes]:
    pos, block, records, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):  # the end, or torn
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(part)
            part = b""
    return records


def _wandb_file_history(path: Path) -> list[dict]:
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        return []
    rows = []
    for raw in _wandb_records(data):
        record = pb.Record()
        try:
            record.ParseFromString(raw)
        except DecodeError:
            continue
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def open_loggers(names: list[str], run_dir: Path, config: dict, project: str,
                 start_step: int = 1) -> list:
    """The sinks `run.loggers` names besides jsonl (RunLog writes that one itself)."""
    out = []
    if "tensorboard" in names:
        out.append(TensorBoardLogger(run_dir, config, start_step))
    if "wandb" in names:
        out.append(WandbLogger(run_dir, config, project, start_step))
    return out
