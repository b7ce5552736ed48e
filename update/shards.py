"""DeepSpeed ZeRO-3's shard layout, the one rule every gather of shards and every shared-memory
write of them follows: rank r keeps elements [r * s, (r + 1) * s) of the flattened parameter,
padded at the end, where s is the size of each rank's shard."""
from __future__ import annotations


def shard_range(rank: int, shard_size: int, numel: int) -> tuple[int, int]:
    """(first element, count) of the flattened full parameter (`numel` elements) that `rank`'s
    shard holds: fewer than shard_size on the last ranks, whose shards end in padding (0 past
    the end)."""
    start = rank * shard_size
    return start, max(0, min(shard_size, numel - start))
