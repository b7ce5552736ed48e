"""Run a function in a world of spawned processes (gloo / DeepSpeed tests), each told its rank
and a free rendezvous port; they report through a shared dict."""
import socket

import torch.multiprocessing as mp


def spawn_world(target, world_size: int, *args, timeout_s: float = 300) -> dict:
    """target(rank, world_size, port, *args, out) in world_size processes; returns out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=target, args=(r, world_size, port, *args, out))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return dict(out)
