"""Sync layout (metadata + flat buckets) and checksums, on plain tensors."""
import pytest
import torch

from weight_sync.checksums import CHECKSUMS, get_checksum
from weight_sync.layout import (ALIGN, TRAILER, SyncLayout, as_int64, flatten_into, new_buffer,
                                plan_layout, read_trailer, unflatten, write_trailer)

SPECS = [("a", [3, 5], torch.float32), ("b", [7], torch.bfloat16), ("c", [100], torch.float32),
         ("d", [2, 2], torch.int64)]


def test_plan_layout_bounds_buckets_aligns_offsets_and_keeps_order():
    layout = plan_layout(SPECS, bucket_bytes=100, version=3, checksum="sum64")
    names = [[t.name for t in b.tensors] for b in layout.buckets]
    assert names == [["a", "b"], ["c"], ["d"]]  # c (400 B) alone, over the bound
    a, b = layout.buckets[0].tensors
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 60, 64, 14)  # 60 -> next 16-multiple
    assert all(t.offset % ALIGN == 0 for bk in layout.buckets for t in bk.tensors)
    assert layout.buckets[0].nbytes == 80 and layout.buckets[0].nbytes % 8 == 0


def test_layout_survives_encoding():
    layout = plan_layout(SPECS, 100, 7, "crc32", {"lm_head.weight": "a"})
    assert SyncLayout.decode(layout.encode()) == layout


def test_flatten_unflatten_round_trip_with_checksum_trailer():
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen)
               .bfloat16(), "c": torch.randn(100, generator=gen),
               "d": torch.tensor([[1, -2], [3, 4]])}
    layout = plan_layout(SPECS, 100, 1, "sum64")
    for bucket in layout.buckets:
        buf = new_buffer(bucket, "cpu")
        assert buf.numel() == bucket.nbytes + TRAILER
        flatten_into(buf, bucket, [tensors[t.name] for t in bucket.tensors])
        write_trailer(buf, bucket, get_checksum("sum64")(buf[:bucket.nbytes]))
        assert read_trailer(buf, bucket) == as_int64(get_checksum("sum64")(buf[:bucket.nbytes]))
        for name, view in unflatten(buf, bucket):
            assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name])


def test_flatten_rejects_a_tensor_that_does_not_fit_the_layout():
    layout = plan_layout([("a", [3], torch.float32)], 100, 1, "sum64")
    buf = new_buffer(layout.buckets[0], "cpu")
    with pytest.raises(ValueError, match="a: got \\[4\\]"):
        flatten_into(buf, layout.buckets[0], [torch.zeros(4)])


@pytest.mark.parametrize("name", sorted(CHECKSUMS))
def test_checksums_see_a_flipped_byte(name):
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator()
                         .manual_seed(1))
    fn = get_checksum(name)
    before = fn(data)
    assert fn(data.clone()) == before  # deterministic
    for pos in (0, 7, 2049, 4095):
        flipped = data.clone()
        flipped[pos] ^= 0x01
        assert fn(flipped) != before


def test_sum64_wraps_like_a_64_bit_register():
    words = torch.tensor([2**63 - 1, 1], dtype=torch.int64).view(torch.uint8)
    assert as_int64(get_checksum("sum64")(words)) == -(2**63)  # wrapped, not a Python bigint


def test_unknown_checksum_lists_known_ones():
    with pytest.raises(KeyError, match="sum64"):
        get_checksum("md5")
