"""The warm-up's noisy targets: how often and by how much they miss."""
import random

from rl.data.warmup import sft_target


def test_noise_offsets_set_the_near_misses():
    rng = random.Random(0)
    got = [int(sft_target("10", 0.65, rng, [1])) for _ in range(4000)]
    assert set(got) == {10, 11}  # a biased base model: one too many, or right
    assert abs(got.count(11) / len(got) - 0.65) < 0.03
    rng = random.Random(0)
    got = {int(sft_target("10", 1.0, rng)) for _ in range(400)}
    assert got == {7, 8, 9, 11, 12, 13}  # the default: -3..+3, never right
    assert sft_target("3/4", 1.0, rng, [1]) == "3/4"  # not an integer: kept
