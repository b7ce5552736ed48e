import math

import pytest

from weight_sync.verify import SyncVerificationError, check_logprobs


def test_within_tolerance_returns_the_max_diff():
    assert check_logprobs([-1.0, -2.0], [-1.0005, -2.0], 1e-3, "rank 0") == pytest.approx(5e-4)


@pytest.mark.parametrize("engine", [[-1.0, -2.5], [-1.0, math.nan], [-1.0]])
def test_mismatch_stops_with_a_clear_error(engine):
    with pytest.raises(SyncVerificationError, match="rank 0"):
        check_logprobs([-1.0, -2.0], engine, 1e-3, "rank 0")
