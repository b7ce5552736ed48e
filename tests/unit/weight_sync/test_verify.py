import math

import pytest

from weight_sync.verify import SyncVerificationError, check_logprobs


def test_within_tolerance_returns_the_max_diff():
    assert check_logprobs([-1.0, -2.0], [-1.0005, -2.0], 1e-3, "rank 0") == pytest.approx(5e-4)


@pytest.mark.parametrize("engine", [[-1.0, -2.5], [-1.0, math.nan], [-1.0]])
def test_mismatch_stops_with_a_clear_error(engine):
    with pytest.raises(SyncVerificationError, match="rank 0"):
        check_logprobs([-1.0, -2.0], engine, 1e-3, "rank 0")


def test_probe_tolerance_by_dtype_and_start_up_noise():
    from weight_sync.verify import probe_tolerance

    assert probe_tolerance("float32", "float32") == 1e-3
    assert probe_tolerance("float32", "float32", noise=0.5) == 1e-3  # fp32 is not calibrated
    assert probe_tolerance("float32", "bfloat16") == 1.0  # not measured yet
    assert probe_tolerance("bfloat16", "float32", noise=0.01) == 0.25  # the floor
    assert probe_tolerance("float32", "bfloat16", noise=0.3) == pytest.approx(1.5)  # 5x noise
    assert probe_tolerance("bfloat16", "bfloat16", configured=0.02, noise=0.3) == 0.02
