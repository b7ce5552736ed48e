"""Post-sync verification: the engine must score a probe sequence like the trainer does."""
from __future__ import annotations

import math


# Largest |trainer - engine| probe logprob after a sync, unless sync.tolerance says otherwise.
# float32 on both sides: the engine's kernels score like the trainer's to ~1e-5. bfloat16
# rounds activations at every layer, differently in vLLM's kernels and under the trainer's
# autocast, by an amount that depends on the model: with the same weights the probe came out
# 0.01-0.02 nats off on the tiny test models and 0.25-0.42 on SmolLM2-135M. So bf16 takes
# BF16_NOISE_FACTOR times that noise as measured at start-up (both sides hold the base model),
# and at least BF16_FLOOR: a stale head, a stale layer or a corrupted bucket after one update
# left the tiny models' probe 0.9-1.7 nats off, caught (tests/integration/test_weight_sync.py).
FP32_TOLERANCE = 1e-3
BF16_FLOOR = 0.25
BF16_NOISE_FACTOR = 5.0
BF16_UNCALIBRATED = 1.0  # before any start-up measurement (e.g. a placement used by a test)


def probe_tolerance(trainer_dtype: str, engine_dtype: str, configured: float | None = None,
                    noise: float | None = None) -> float:
    """sync.tolerance when set; else 1e-3 when both sides compute in float32, else from the
    start-up noise (see above)."""
    if configured is not None:
        return configured
    if trainer_dtype == engine_dtype == "float32":
        return FP32_TOLERANCE
    if noise is None:
        return BF16_UNCALIBRATED
    return max(BF16_FLOOR, BF16_NOISE_FACTOR * noise)


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
            f"rather than sample from a stale model.")
    return diff
