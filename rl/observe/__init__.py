"""Watching a run: metrics.jsonl, loggers (TensorBoard, W&B), the timeline, progress lines.
Imports rl.config and rl.errors only."""
