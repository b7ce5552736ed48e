"""Faults the tests inject into the real sync, from outside it: the production code carries no
fault parameter. Each patches the process it runs in (a test's, or an actor's through
`__ray_call__`) for one call and puts everything back."""
from __future__ import annotations

import itertools


def corrupt_next_send(bucket: int) -> None:
    """The next `BroadcastTransport.send` in this process flips bytes of bucket `bucket` after
    its checksum is written into the trailer: what the receiver's check must catch."""
    from weight_sync import transport

    cls, send = transport.BroadcastTransport, transport.BroadcastTransport.send
    if getattr(send, "rl_fault", False):
        raise RuntimeError("a corrupted send is pending in this process already")

    def corrupted_send(self, module, version):
        write = transport.write_trailer
        posted = itertools.count()  # the buckets go on the wire in index order

        def write_then_flip(buffer, meta, value):
            write(buffer, meta, value)
            if next(posted) == bucket:
                buffer[:min(8, meta.nbytes)] ^= 0x5A

        transport.write_trailer = write_then_flip
        try:
            return send(self, module, version)
        finally:
            transport.write_trailer = write
            cls.send = send  # once

    corrupted_send.rl_fault = True
    cls.send = corrupted_send


def corrupt_next_send_on_actor(_actor, bucket: int) -> None:
    """`corrupt_next_send` in a trainer actor: `ray.get(t.__ray_call__.remote(
    corrupt_next_send_on_actor, bucket))`."""
    corrupt_next_send(bucket)
