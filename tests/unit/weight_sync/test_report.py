"""The sync report: each side's counts and times, joined as the placements join them, and the
run's sync/* metrics, with the same keys for every sync of one kind."""
from weight_sync.buckets import SyncStats
from weight_sync.report import SyncReport, broadcast, slowest


def stats(nbytes: int, buckets: int, **seconds: float) -> SyncStats:
    return SyncStats(num_buckets=buckets, bytes=nbytes, max_bucket_bytes=nbytes // buckets,
                     seconds=dict(seconds))


def colocated_rank(nbytes: int, write: float, shared: bool, diff: float) -> SyncReport:
    report = SyncReport.of(stats(nbytes, 1, write=write), bytes_per_tp_rank=nbytes)
    report.seconds = write + 0.01
    report.ways = {"direct_load": True, "shared_weights": shared}
    report.exact(0.002, 3)
    report.phases.update(probe_trainer=0.1, probe_engine=0.2)
    report.probe(diff, 1e-3)
    return report


def test_colocated_ranks_join_as_the_slowest_and_every_way_must_be_taken():
    joined = slowest([colocated_rank(400, 0.5, True, 1e-4),
                      colocated_rank(400, 0.7, False, 3e-4)])
    m = joined.metrics()
    assert m == {"sync/bytes": 400, "sync/bytes_per_tp_rank": 400, "sync/num_buckets": 1,
                 "sync/max_bucket_bytes": 400, "sync/seconds": 0.71, "sync/exact_ranges": 3.0,
                 "sync/logprob_max_abs_diff": 3e-4, "sync/tolerance": 1e-3,
                 "sync/direct_load": 1.0, "sync/shared_weights": 0.0, "sync/write_seconds": 0.7,
                 "sync/exact_seconds": 0.002, "sync/probe_trainer_seconds": 0.1,
                 "sync/probe_engine_seconds": 0.2}
    assert all(type(m[k]) is int for k in ("sync/bytes", "sync/num_buckets"))
    assert all(type(v) is float for k, v in m.items() if "seconds" in k or "ways" in k)


def test_a_broadcast_reports_the_senders_buckets_and_the_slowest_receiver():
    sent = SyncReport.of(stats(1000, 4, gather=0.2, wire=0.3), "send", ways={"in_place": True})
    sent.phases = {"send": 0.6, **sent.phases}
    received = [SyncReport.of(stats(1000, 4, wire=w), "receive", bytes_per_tp_rank=b,
                              ways={"direct_load": d}) for w, b, d in
                [(0.4, 500, True), (0.1, 520, False)]]
    for r in received:
        r.phases["receive"] = 0.5
    report = broadcast(sent, received, seconds=0.9)
    report.ways["cross_host"] = 0.0
    report.exact(0.05, 7)
    report.probe(2e-4, 1e-3)
    m = report.metrics()
    assert m["sync/seconds"] == 0.9 and m["sync/bytes"] == 1000 and m["sync/num_buckets"] == 4
    assert m["sync/max_bucket_bytes"] == 250 and m["sync/bytes_per_tp_rank"] == 520
    assert m["sync/in_place"] == 1.0 and m["sync/direct_load"] == 0.0
    assert m["sync/cross_host"] == 0.0 and m["sync/exact_ranges"] == 7.0
    assert {k: v for k, v in m.items() if k.startswith(("sync/send", "sync/receive"))} == {
        "sync/send_seconds": 0.6, "sync/send_gather_seconds": 0.2, "sync/send_wire_seconds": 0.3,
        "sync/receive_wire_seconds": 0.4, "sync/receive_seconds": 0.5}
    assert sent.seconds is None and "exact" not in sent.phases  # the sender's own is untouched


def test_a_field_no_side_set_is_not_a_metric():
    m = SyncReport(bytes=10, ways={"direct_load": False}).metrics()
    assert m == {"sync/bytes": 10, "sync/direct_load": 0.0}
