"""What one sync did, as one report, and the run's sync/* metrics made from reports in one place.

Each side of a sync returns a `SyncReport`: a colocated worker's rank (weight_sync.colocated), a
broadcast's sender and each receiver (weight_sync.broadcast). The placement that fanned the
sync out combines them (`slowest` over colocated ranks, `broadcast` for a sender and its
receivers), adds what it checked (`exact`, `probe`) and reads `metrics()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from weight_sync.buckets import SyncStats


@dataclass
class SyncReport:
    """A field left None is not a metric of this kind of sync (so every sync of one run reports
    the same keys)."""

    bytes: int = 0  # the model's bytes moved (at TP > 1: what every TP rank received, summed)
    bytes_per_tp_rank: int | None = None  # the most bytes one TP rank received
    num_buckets: int | None = None
    max_bucket_bytes: int | None = None
    seconds: float | None = None  # the transfer (colocated: a rank's; broadcast: the whole sync)
    phases: dict[str, float] = field(default_factory=dict)  # sync/<phase>_seconds
    # ways it went, each 1.0 or 0.0: direct_load, shared_weights, in_place, cross_host
    ways: dict[str, bool] = field(default_factory=dict)
    exact_ranges: int | None = None  # ranges checked byte for byte (0: not checked)
    logprob_max_abs_diff: float | None = None  # the probe's, trainer against engine
    tolerance: float | None = None  # the probe check's

    @classmethod
    def of(cls, stats: SyncStats, side: str = "", **fields) -> SyncReport:
        """A transfer's counts and timed phases (named `<side>_<phase>` for a broadcast's
        sender "send" or receiver "receive")."""
        prefix = f"{side}_" if side else ""
        return cls(bytes=stats.bytes, num_buckets=stats.num_buckets,
                   max_bucket_bytes=stats.max_bucket_bytes,
                   phases={prefix + p: s for p, s in stats.seconds.items()}, **fields)

    def exact(self, seconds: float, ranges: int) -> None:
        """The byte-for-byte check's (weight_sync.exact): its time and the ranges it checked."""
        self.phases["exact"] = seconds
        self.exact_ranges = ranges

    def probe(self, max_abs_diff: float, tolerance: float) -> None:
        """The probe check's (weight_sync.verify.check_logprobs): passed, this far apart."""
        self.logprob_max_abs_diff, self.tolerance = max_abs_diff, tolerance

    def metrics(self) -> dict[str, float]:
        """sync/<name>: byte and bucket counts as integers, the rest as floats (a way 1.0 or
        0.0)."""
        counts = {"sync/bytes": self.bytes, "sync/bytes_per_tp_rank": self.bytes_per_tp_rank,
                  "sync/num_buckets": self.num_buckets,
                  "sync/max_bucket_bytes": self.max_bucket_bytes}
        values = {"sync/seconds": self.seconds, "sync/exact_ranges": self.exact_ranges,
                  "sync/logprob_max_abs_diff": self.logprob_max_abs_diff,
                  "sync/tolerance": self.tolerance,
                  **{f"sync/{way}": taken for way, taken in self.ways.items()},
                  **{f"sync/{phase}_seconds": s for phase, s in self.phases.items()}}
        return {**{k: int(v) for k, v in counts.items() if v is not None},
                **{k: float(v) for k, v in values.items() if v is not None}}


def slowest(reports: list[SyncReport]) -> SyncReport:
    """The ranks of one collective sync (colocated) as one: each count and time the largest
    (the slowest rank's), a way taken only if every rank took it."""
    def most(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    first = reports[0]
    return SyncReport(
        bytes=most(r.bytes for r in reports),
        bytes_per_tp_rank=most(r.bytes_per_tp_rank for r in reports),
        num_buckets=most(r.num_buckets for r in reports),
        max_bucket_bytes=most(r.max_bucket_bytes for r in reports),
        seconds=most(r.seconds for r in reports),
        phases={p: most(r.phases.get(p) for r in reports) for p in first.phases},
        ways={w: all(r.ways[w] for r in reports) for w in first.ways},
        exact_ranges=most(r.exact_ranges for r in reports),
        logprob_max_abs_diff=most(r.logprob_max_abs_diff for r in reports),
        tolerance=most(r.tolerance for r in reports))


def broadcast(sent: SyncReport, received: list[SyncReport], seconds: float) -> SyncReport:
    """A broadcast sync as one: what the sender sent, and of its receivers the most one TP rank
    took and the slowest's times; a way (direct load) only if every engine took it.
    `seconds`: the whole sync's, as its caller timed it."""
    engines = slowest(received)
    return replace(sent, seconds=seconds, bytes_per_tp_rank=engines.bytes_per_tp_rank,
                   phases={**sent.phases, **engines.phases},
                   ways={**sent.ways, **engines.ways})
