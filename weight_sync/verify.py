"""Post-sync verification: the engine must score a probe sequence like the trainer does."""
from __future__ import annotations


class SyncVerificationError(RuntimeError):
    """The rollout engine's weights do not match the trainer's after a sync."""


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise SyncVerificationError(f"probe lengths differ: trainer {len(a)} vs engine {len(b)}")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def check_logprobs(trainer: list[float], engine: list[float], tolerance: float, where: str) -> float:
    """max |trainer - engine| over the probe; raises SyncVerificationError above tolerance."""
    diff = max_abs_diff(trainer, engine)
    if not diff <= tolerance:  # also catches NaN
        raise SyncVerificationError(
            f"{where}: after the weight sync the rollout engine's probe logprobs differ from the "
            f"trainer's by {diff:.3g} > sync.tolerance={tolerance:g}. The engine holds other weights "
            f"than the trainer (a missed or misnamed tensor, e.g. a tied lm_head); the run stops "
            f"rather than sample from a stale model. With bf16 on either side raise sync.tolerance.")
    return diff
