"""A worker actor holds its roles as parts and forwards their methods (Ray makes an actor's
remote methods from its class): what is forwarded, what is the actor's own, and two parts
offering one name. What a role builds to last is kept out of the collector's passes, and
collected once let go."""
import gc
import inspect
import weakref

import pytest

from rl.observe.timeline import Spans, traced
from rl.run.role import OnProcess, Process, holds, lasting


class Trainer(OnProcess):
    def __init__(self, process: Process):
        self.process = process

    @traced("update")
    def train(self, batch: list, scale: float = 1.0) -> float:
        """One step."""
        return sum(batch) * scale + self.rank

    def free_models(self) -> str:
        return "trainer freed"

    def _private(self) -> None:
        raise AssertionError("not forwarded")


class Engine(OnProcess):
    def __init__(self, process: Process):
        self.process = process

    def generate(self, prompt: str) -> str:
        return prompt + "!"

    def free_models(self) -> str:
        return "engine freed"


class Base:
    def hostname(self) -> str:
        return "the actor's own"


@holds(trainer_role=Trainer, engine_role=Engine)
class Worker(Base):
    def __init__(self):
        self.process = Process(rank=3, world_size=4, device="cpu")
        self.trainer_role, self.engine_role = Trainer(self.process), Engine(self.process)

    def free_models(self) -> list:
        return [self.trainer_role.free_models(), self.engine_role.free_models()]


def test_each_parts_public_methods_become_the_actors_with_their_signature_and_trace():
    w = Worker()
    assert w.train([1, 2], scale=2.0) == 9.0  # rank 3, read from the shared process
    assert w.generate("hi") == "hi!"
    assert inspect.signature(Worker.train) == inspect.signature(Trainer.train)  # what Ray checks
    assert Worker.train.__doc__ == "One step."
    assert [name for name, *_ in w.process.spans.drain()] == ["update"]
    assert not hasattr(Worker, "_private")
    assert w.free_models() == ["trainer freed", "engine freed"]  # defined by the actor: kept
    assert w.hostname() == "the actor's own"  # a base's method is not replaced
    assert Worker.parts == {"trainer_role": Trainer, "engine_role": Engine}  # made by a Role


def test_the_parts_see_the_processs_facts_as_they_change():
    w = Worker()
    w.process.spans = Spans()  # an actor's free_models starts a new track
    w.train([0])
    assert w.trainer_role.spans is w.process.spans and len(w.process.spans.drain()) == 1


def test_a_name_two_parts_offer_must_be_the_actors_own():
    with pytest.raises(TypeError, match="free_models is offered by its parts"):
        @holds(trainer_role=Trainer, engine_role=Engine)
        class Ambiguous:
            pass


class Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_what_is_built_to_last_is_frozen_its_garbage_collected_and_a_replaced_build_freed():
    gc.unfreeze()
    try:
        with lasting():
            assert not gc.isenabled()  # no pass during the build
            kept, dropped = Node(), Node()
            dropped = weakref.ref(dropped)  # garbage the build leaves
        assert gc.isenabled() and dropped() is None
        assert gc.is_tracked(kept) and gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        gc.collect()
        assert gc.get_freeze_count() == frozen  # kept out of the passes
        kept = weakref.ref(kept)  # let go, but frozen: no pass frees it...
        with lasting():
            pass
        assert kept() is not None
        with lasting(replaces=True):  # ...until a build that replaces it thaws it first
            assert kept() is None
    finally:
        gc.enable()
        gc.unfreeze()


class Ports:
    """An rng whose randrange returns the given ports in turn."""

    def __init__(self, *ports):
        self.ports = list(ports)

    def randrange(self, low, high):
        return self.ports.pop(0)


def test_a_rendezvous_port_is_free_and_not_one_the_kernel_gives_outgoing_connections(
        tmp_path, monkeypatch):
    import socket

    from rl.run import role

    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")
    monkeypatch.setattr(role, "EPHEMERAL", str(ephemeral))
    for _ in range(20):
        assert 20000 <= role.rendezvous_port() < 32768
    with socket.socket() as taken:  # a port in use is passed over
        taken.bind(("", 0))
        busy = taken.getsockname()[1]
        assert role.rendezvous_port(rng=Ports(busy, 23456)) == 23456
    ephemeral.write_text("1024 65535\n")  # no room below the kernel's range: bind(0)'s port
    assert role.rendezvous_port(rng=Ports()) > 0
