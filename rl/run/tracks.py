"""The run's timeline.json: after each recorded step, the spans that the driver and every actor
recorded since the last one, one track per process."""
from __future__ import annotations

from rl.observe.timeline import Spans, Timeline


def actor_tracks(placement) -> list[tuple[str, object]]:
    """(track name, actor) for every actor of the placement, trainers first."""
    if placement.colocated:  # an engine per worker, or per tp workers at TP > 1
        tp = len(placement.trainers) // max(1, len(placement.engines))
        return [(f"worker {i} (trainer rank {i} + engine {i // tp}"
                 + (f", TP rank {i % tp})" if tp > 1 else ")"), w)
                for i, w in enumerate(placement.trainers)]
    return ([(f"trainer rank {i}", w) for i, w in enumerate(placement.trainers)]
            + [(f"rollout engine {i}", e) for i, e in enumerate(placement.engines)])


def dead_actor(placement, error) -> str:
    """'trainer rank 1' (or the engine, or colocated worker) whose process died."""
    dead = getattr(error, "actor_id", None)
    for name, actor in (actor_tracks(placement) if placement is not None else []):
        if dead is not None and actor._actor_id.hex() == dead:
            return name
    return "an actor"


class TimelineRecorder:
    """Writes timeline.json for steps up to run.timeline_steps (the set-up as step 0, the final
    save); past them, has every process stop recording spans nobody reads."""

    def __init__(self, spans: Spans):
        self.spans = spans  # the driver's track
        self.timeline: Timeline | None = None  # None: run.timeline_steps is 0
        self.quiet_placement = None  # the placement whose actors stopped recording spans

    def start(self, path, steps: int, keep_until: int | None) -> None:
        """A timeline at path (keeping a resumed run's spans up to step keep_until); the driver
        records again (decided anew for a new placement)."""
        self.spans.enabled = True
        self.timeline = Timeline(path, steps, keep_until=keep_until) if steps > 0 else None

    def record(self, placement, step: int, final: bool = False) -> None:
        """Add the spans every process recorded since the last call."""
        import ray

        if self.timeline is None or not (self.timeline.recording(step) or final):
            if placement is not None and self.quiet_placement is not placement:
                # once per placement: no process keeps recording spans nobody reads
                ray.get([a.drain_spans.remote(False) for _, a in actor_tracks(placement)])
                self.spans.enabled = False
                self.quiet_placement = placement
            return
        keep = not final and self.timeline.recording(step + 1)
        tracks = actor_tracks(placement) if placement is not None else []
        spans = ray.get([a.drain_spans.remote(keep) for _, a in tracks])
        self.timeline.add("driver (controller)", self.spans.drain(), step)
        for (name, _), items in zip(tracks, spans):
            self.timeline.add(name, items, step)
        self.timeline.write()
        self.spans.enabled = keep
