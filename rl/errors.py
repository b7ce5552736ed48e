"""Failures a person reads: why an actor died, why prompts cannot be used."""
from __future__ import annotations

from rl.schema import Config


class ActorFailure(RuntimeError):
    """An actor of the run died and no restart is left."""


def death_cause(error) -> str:
    """Why an actor died, in a few words, from Ray's error."""
    text = str(error)
    if "out of memory" in text.lower() or "OutOfMemory" in text:
        return "out of memory (the node's memory monitor killed it)"
    for marker in ("SIGKILL", "SIGSEGV", "SIGTERM", "exit code", "exited", "killed"):
        if marker in text:
            line = next(x for x in text.splitlines() if marker in x).strip()
            return line[:200]
    return text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__


def get_all(futures: list, peers: list = (), grace_s: float = 10.0) -> list:
    """ray.get(futures), but when a call fails and another of them, or of `peers` (the other
    side's calls of the same collective), belongs to an actor that died, that death is raised
    (a RayActorError, which the controller recovers from): when one rank of a collective dies,
    the live ranks fail first ("Connection closed by peer"), and ray.get would raise their
    error. Waits at most grace_s for the others before raising the first error as it is."""
    import time

    import ray

    try:
        return ray.get(futures)
    except ray.exceptions.RayTaskError as first:
        pending, deadline = [*futures, *peers], time.monotonic() + grace_s
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for future in ready:
                try:
                    ray.get(future)
                except ray.exceptions.RayActorError as dead:
                    raise dead from first
                except ray.exceptions.RayError:
                    pass
        raise


def last_line(error) -> str:
    """An exception's last line (Ray's errors end with the original one), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def prompt_error(e: Exception, cfg: Config) -> str:
    """One line for a data set the tokenizer cannot render (or that does not fit)."""
    text = str(e.args[0]) if e.args else str(e)
    if "chat_template" in text or "chat template" in text:
        return (f"model.path={cfg.model.path!r}: its tokenizer has no chat template, and prompts "
                f"are rendered as chat messages; use an instruct/chat model or add a "
                f"chat_template to its tokenizer_config.json")
    return f"data.train_path={cfg.data.train_path!r}: {text}"


def stop_on_sigterm() -> None:
    """SIGTERM (`ray job stop`, `kill`) stops the run like Ctrl-C: actors stopped, logs closed.
    Installed again after ray.init, which replaces the handler with its own sys.exit."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
