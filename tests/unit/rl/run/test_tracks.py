"""The timeline's track per actor: colocated workers once each (at TP > 1, which engine and TP
rank each holds), disaggregated trainers then engines."""
from types import SimpleNamespace

from rl.run.tracks import actor_tracks


def test_colocated_workers_are_one_track_each_naming_their_engine_and_tp_rank():
    workers = ["w0", "w1", "w2", "w3"]
    tp1 = SimpleNamespace(colocated=True, trainers=workers, engines=list(workers))
    assert [n for n, _ in actor_tracks(tp1)] == [
        f"worker {i} (trainer rank {i} + engine {i})" for i in range(4)]
    tp2 = SimpleNamespace(colocated=True, trainers=workers, engines=workers[::2])
    assert actor_tracks(tp2) == [
        ("worker 0 (trainer rank 0 + engine 0, TP rank 0)", "w0"),
        ("worker 1 (trainer rank 1 + engine 0, TP rank 1)", "w1"),
        ("worker 2 (trainer rank 2 + engine 1, TP rank 0)", "w2"),
        ("worker 3 (trainer rank 3 + engine 1, TP rank 1)", "w3")]


def test_disaggregated_trainers_then_engines():
    placement = SimpleNamespace(colocated=False, trainers=["t0", "t1"], engines=["e0"])
    assert actor_tracks(placement) == [("trainer rank 0", "t0"), ("trainer rank 1", "t1"),
                                       ("rollout engine 0", "e0")]
