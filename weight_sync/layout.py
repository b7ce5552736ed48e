"""The sync's metadata and the flat bucket format, both pure.

One `SyncLayout` per sync goes out first (names, shapes, dtypes, bucket layout, policy version);
then each bucket travels as one flat uint8 buffer: the tensors' bytes back to back at 16-byte
aligned offsets, then 8 bytes holding the bucket's checksum. The receiver needs nothing else to
cut the buffer back into tensors.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

ALIGN = 16  # bytes: every tensor's offset, so a uint8 view can be reinterpreted as any dtype
TRAILER = 8  # bytes of checksum after the data


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class TensorMeta:
    name: str
    shape: list[int]
    dtype: str
    offset: int  # bytes from the start of the bucket
    # in-place syncs into a TP rank: [dim, start, length] of the full tensor this is the slice
    # of (resharding.Shard; the shape is the slice's), else None: the whole tensor
    shard: list[int] | None = None

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * getattr(torch, self.dtype).itemsize


@dataclass
class BucketMeta:
    tensors: list[TensorMeta]
    nbytes: int  # data bytes, aligned; the buffer is nbytes + TRAILER long
    start: int = 0  # in-place syncs: where the bucket lies in the engine's packed weights
    rank: int = 0  # ... of that TP rank's (weight_sync.in_place.plan_in_place)


@dataclass
class SyncLayout:
    version: int
    checksum: str
    buckets: list[BucketMeta]
    aliases: dict[str, str] = field(default_factory=dict)  # extra name -> sent name (tied heads)
    in_place: str = ""  # digest of the engine layout the buckets tile (weight_sync.in_place)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(data: bytes) -> "SyncLayout":
        raw = json.loads(data)
        buckets = [BucketMeta([TensorMeta(**t) for t in b["tensors"]], b["nbytes"], b["start"],
                              b["rank"]) for b in raw["buckets"]]
        return SyncLayout(raw["version"], raw["checksum"], buckets, raw["aliases"],
                          raw["in_place"])


def plan_layout(specs: list[tuple[str, list[int], torch.dtype]], bucket_bytes: int, version: int,
                checksum: str, aliases: dict[str, str] | None = None) -> SyncLayout:
    """Place (name, full shape, dtype) in order into buckets of at most bucket_bytes of data
    (a larger tensor travels alone)."""
    buckets: list[BucketMeta] = []
    current: list[TensorMeta] = []
    offset = 0
    for name, shape, dtype in specs:
        meta = TensorMeta(name, list(shape), dtype_name(dtype), 0)
        if current and offset + meta.nbytes > bucket_bytes:
            buckets.append(BucketMeta(current, offset))
            current, offset = [], 0
        meta.offset = offset
        current.append(meta)
        offset = _align(offset + meta.nbytes)
    if current:
        buckets.append(BucketMeta(current, offset))
    return SyncLayout(version, checksum, buckets, dict(aliases or {}))


def new_buffer(bucket: BucketMeta, device: str) -> torch.Tensor:
    return torch.empty(bucket.nbytes + TRAILER, dtype=torch.uint8, device=device)


def flatten_into(buffer: torch.Tensor, bucket: BucketMeta, tensors: list[torch.Tensor]) -> None:
    """Copy the bucket's tensors (in layout order) into its flat buffer; padding is zeroed so the
    checksum covers defined bytes only."""
    end = 0
    for meta, t in zip(bucket.tensors, tensors, strict=True):
        if list(t.shape) != meta.shape or dtype_name(t.dtype) != meta.dtype:
            raise ValueError(f"{meta.name}: got {list(t.shape)} {t.dtype}, the layout says "
                             f"{meta.shape} {meta.dtype}")
        buffer[end:meta.offset].zero_()
        view = buffer[meta.offset:meta.offset + meta.nbytes]
        view.view(t.dtype).view(t.shape).copy_(t)
        end = meta.offset + meta.nbytes
    buffer[end:bucket.nbytes].zero_()


def unflatten(buffer: torch.Tensor, bucket: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors into its buffer (no copy)."""
    return [(m.name, buffer[m.offset:m.offset + m.nbytes].view(getattr(torch, m.dtype))
             .view(m.shape)) for m in bucket.tensors]


def write_trailer(buffer: torch.Tensor, bucket: BucketMeta, value: int) -> None:
    buffer[bucket.nbytes:].view(torch.int64).fill_(as_int64(value))


def read_trailer(buffer: torch.Tensor, bucket: BucketMeta) -> int:
    return int(buffer[bucket.nbytes:].view(torch.int64)[0])


def as_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
