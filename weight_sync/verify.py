"""Post-sync verification: the engine must score a probe sequence like the trainer does."""
from __future__ import annotations

import math


class SyncVerificationError(RuntimeError):
    """The rollout engine's weights do not match the trainer's after a sync."""


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """max |a - b|; NaN when any entry is NaN (the builtin max would skip past it)."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    if any(math.isnan(d) for d in diffs):
        return math.nan
    return max(diffs, default=0.0)


def check_logprobs(trainer: list[float], engine: list[float], tolerance: float, where: str) -> float:
    """max |trainer - engine| over the probe; raises SyncVerificationError above tolerance."""
    if len(trainer) != len(engine):
        raise SyncVerificationError(f"{where}: probe logprobs of different lengths: trainer "
                                    f"{len(trainer)} vs engine {len(engine)}")
    diff = max_abs_diff(trainer, engine)
    if not diff <= tolerance:  # also catches NaN
        raise SyncVerificationError(
            f"{where}: after the weight sync the rollout engine's probe logprobs differ from the "
            f"trainer's by {diff:.3g} > sync.tolerance={tolerance:g}. The engine holds other weights "
            f"than the trainer (a missed or misnamed tensor, e.g. a tied lm_head); the run stops "
            f"rather than sample from a stale model. With bf16 on either side raise sync.tolerance.")
    return diff
