"""timeline.json: Chrome trace events, one track per process, spans on the wall clock."""
import json
import time

from rl.observe.timeline import Spans, Timeline, traced


class Actor:
    def __init__(self):
        self.spans = Spans()

    @traced("generate")
    def generate(self, x):
        time.sleep(0.01)
        return x * 2


def test_traced_methods_record_spans_and_drain_empties(tmp_path):
    actor = Actor()
    assert actor.generate(3) == 6
    (name, start, end, args), = actor.spans.drain()
    assert name == "generate" and end - start >= 0.01 and args == {}
    assert actor.spans.drain() == []
    actor.spans.enabled = False
    actor.generate(1)
    assert actor.spans.drain() == []


def test_timeline_writes_one_track_per_process(tmp_path):
    line = Timeline(tmp_path / "timeline.json", max_steps=2)
    assert line.recording(2) and not line.recording(3)
    line.add("driver (controller)", [("update", 10.0, 10.5, {})], step=1)
    line.add("trainer rank 0", [("update", 10.1, 10.4, {})], step=1)
    line.add("driver (controller)", [("sync", 11.0, 11.25, {})], step=2)
    line.write()
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "driver (controller)", 1: "trainer rank 0"}
    spans = [(e["pid"], e["name"], e["ts"], e["dur"], e["args"]["step"])
             for e in events if e["ph"] == "X"]
    assert spans == [(0, "update", 10_000_000, 500_000, 1), (1, "update", 10_100_000, 300_000, 1),
                     (0, "sync", 11_000_000, 250_000, 2)]
