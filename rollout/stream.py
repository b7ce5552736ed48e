"""Streaming generation: one vLLM engine driven step by step in a thread of its own, so that
requests keep arriving while it works and a weight sync can take place between two scheduler
steps (the asynchronous pipeline modes).

Every token records the policy version whose weights produced it, beside its logprob under
them (the behavior logprob). A sync first pauses the loop between two steps:

- interrupting (`pause(interrupt=True)`): each sequence in flight is aborted, keeping what it
  has generated; after the new weights are in (and checked), it goes on as a new request whose
  prompt is the old prompt plus those tokens. Its KV is recomputed under the new weights, and
  the prefix cache, reset while no request holds a block, never serves a block computed with
  older weights. Constrained (structured-output) sequences are never cut: their grammar state
  would be lost, so the pause waits for them.
- draining (`pause(interrupt=False)`): no new request starts, and the pause waits until the
  sequences in flight have finished under the weights that began them. A multi-turn
  trajectory is drained turn by turn: one whose environment is stepping is not waited for,
  and its next turn runs under the new weights (each token keeps its version).

While paused the engine holds no request, so the caller may score a probe on it (vLLM's
blocking `generate`) before `resume` lets generation go on under the new version.

Multi-turn (`turns`, a TurnHandler): when a model turn ends, the handler steps the
trajectory's environment in a worker thread (the engine goes on stepping the others: no turn
barrier); its observation tokens are appended after the sampled ones (logprob 0, loss mask 0,
never re-tokenized) and the trajectory goes back into the engine as a new request, like a
sequence cut by a sync, until the handler says done, the environment fails, or the token
budget (max_new_tokens: the model's and the environment's tokens together) is spent.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class TurnResult:
    """What the environment made of one model turn."""

    observation: list[int] = field(default_factory=list)
    "Token ids to append before the next model turn (the template's delta); [] when done."
    done: bool = False
    info: dict = field(default_factory=dict)
    "Counts summed over the trajectory (tool_calls, tool_errors, env_seconds, ...)."
    truncated: bool = False
    "Ended by a limit (turns), not by the model's answer."
    error: str = ""
    "Why the environment failed (raised, timed out, returned garbage): the trajectory ends."
    next_turn_tokens: int | None = None
    "The most tokens of the next model turn (None: the loop's turn_tokens; < 1 truncates)."
    reward: float | None = None
    "The environment's reward of the trajectory, when it gives one (at done)."
    prompt: list[int] | None = None
    ("A prompt the trajectory (re)starts from, its tokens so far dropped: a handler that makes "
     "the first prompt itself (`begin`), or a new branch (an agent whose history no longer "
     "continues the tokens).")


def _result_problem(result) -> str:
    """What is wrong with a turn handler's answer ('' when it is a well-formed TurnResult)."""
    if not isinstance(result, TurnResult):
        return f"the turn handler returned {type(result).__name__}, not a TurnResult"
    if not isinstance(result.observation, list) or not all(
            type(t) is int for t in result.observation + (result.prompt or [])):
        return "the turn handler's observation or prompt is not a list of token ids"
    if not isinstance(result.info, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in result.info.values()):
        return f"the turn handler's info {result.info!r} is not a dict of numbers"
    return ""


class TurnHandler(Protocol):
    """Optional besides: `begin(state) -> TurnResult` (in a worker thread, before the first
    turn: its `prompt` replaces the submitted one; e.g. an agent program's first call) and
    `finish(state)` (the trajectory ended, for any reason, or the loop stopped)."""

    def start(self, key: object, index: int, greedy: bool) -> object:
        """The state (e.g. an environment) of sample `index` of group `key`, made at submit;
        greedy: the loop samples greedily (evaluation)."""

    def step(self, state: object, turn_ids: list[int], finish_reason: str,
             logprobs: list[float]) -> TurnResult:
        """Step the environment with the model turn just sampled; runs in a worker thread."""


@dataclass
class _Sample:
    group: object  # the caller's key of the group this sample belongs to
    index: int  # the sample's place in its group
    prompt: list[int]
    seed: int | None
    constraint: dict | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    segments: int = 0  # engine requests so far (1 + the times it was interrupted)
    seen: int = 0  # tokens of the current engine request already recorded
    # multi-turn: 1 per model token, 0 per environment token; where the current turn starts
    mask: list[int] = field(default_factory=list)
    turn_start: int = 0
    turns: int = 0  # model turns finished
    turn_limit: int | None = None  # the most tokens of the current turn (None: turn_tokens)
    state: object = None  # the TurnHandler's (the trajectory's environment)
    info: dict = field(default_factory=dict)
    truncated: bool = False
    error: str = ""
    env_reward: float | None = None


class GenerationLoop:
    """Feeds `submit`ted groups to `engine` (a rollout.vllm_engine.VLLMEngine) and steps it
    until the loop is paused or stopped; `collect` returns finished groups."""

    def __init__(self, engine, version: int, n: int, max_new_tokens: int,
                 turns: TurnHandler | None = None, turn_tokens: int | None = None,
                 env_workers: int = 16, greedy: bool = False):
        """`turns`: multi-turn (module docstring); `turn_tokens`: the most tokens of one model
        turn (None: max_new_tokens); `env_workers`: environment steps run at once; `greedy`:
        the most likely token at every step (evaluation)."""
        self.engine, self.version, self.n, self.max_new_tokens = engine, version, n, max_new_tokens
        self.greedy = greedy
        self.turns, self.turn_tokens = turns, turn_tokens or max_new_tokens
        self.env_pool = ThreadPoolExecutor(env_workers, "env-step") if turns else None
        self.begins = turns is not None and callable(getattr(turns, "begin", None))
        self.finishes = turns is not None and callable(getattr(turns, "finish", None))
        self.live: dict[int, _Sample] = {}  # not finished yet (for `finish` at stop)
        cfg = getattr(engine, "cfg", None)
        self.max_model_len = getattr(cfg, "max_model_len", None)
        self.cv = threading.Condition()
        self.waiting: list[_Sample] = []  # not in the engine: new, or cut by a sync
        self.running: dict[str, _Sample] = {}  # engine request id -> sample
        self.groups: dict[object, list[_Sample | None]] = {}
        self.done: list[dict] = []
        self.hold = self.paused = self.stopped = False
        self.pausing = None  # 'interrupt' | 'drain' while a pause is asked for
        self.error: BaseException | None = None
        self.next_id = 0
        self.steps = 0  # scheduler steps run (a test reads it)
        self.idle_seconds = 0.0  # no work, not paused
        self.paused_seconds = 0.0
        self.interrupted = 0  # sequences cut by a sync
        import torch

        # OpenMP sizes a new thread's team afresh; vLLM-CPU's attention insists that it equal
        # the one the engine was built with
        self._threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._run, name="generation-loop", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ caller side
    def submit(self, groups: list[tuple[object, list[int], int | None, dict | None]]) -> None:
        """(key, prompt ids, seed, constraint) per group; sample j of a group gets seed + j."""
        made = []
        for key, prompt, seed, constraint in groups:
            samples = [_Sample(key, j, list(prompt), None if seed is None else seed + j,
                               constraint) for j in range(self.n)]
            for x in samples if self.turns else ():  # user code (env resets): outside the lock,
                x.state = self.turns.start(key, x.index, self.greedy)  # nothing in if one raises
            made.append((key, samples))
        with self.cv:
            for key, samples in made:
                self.groups[key] = [None] * self.n
                if self.finishes:
                    self.live.update((id(x), x) for x in samples)
                if self.begins:  # the handler makes the first prompt (in a worker thread)
                    for x in samples:
                        self.env_pool.submit(self._step_env, x, True)
                else:
                    self.waiting.extend(samples)
            self.cv.notify_all()

    def collect(self, timeout_s: float) -> list[dict]:
        """The groups finished since the last call, waiting up to timeout_s for at least one:
        {"key", "completions": [{token_ids, logprobs, versions, finish_reason, text}]}."""
        with self.cv:
            self.cv.wait_for(lambda: self.done or self.error is not None, timeout=timeout_s)
            self._raise()
            out, self.done = self.done, []
            return out

    def pause(self, interrupt: bool) -> None:
        """Stop between two scheduler steps with no request left in the engine (see the module
        docstring for what happens to the sequences in flight). Idempotent. The loop itself
        pauses at its next step boundary: a caller waiting for the lock between two steps
        could wait for ever."""
        with self.cv:
            if self.paused:
                return
            self.pausing = "interrupt" if interrupt else "drain"
            self.hold = True
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.paused or self.error is not None)
            self._raise()

    def resume(self, version: int) -> None:
        """Go on under policy `version` (its weights are in the engine and were checked)."""
        with self.cv:
            if self.paused:
                self.paused_seconds += time.perf_counter() - self._paused_at
            self.version = version
            self.paused = self.hold = False
            self.cv.notify_all()

    def take_times(self) -> dict:
        """Seconds the engine sat idle (no work) and paused (syncs) since the last call."""
        with self.cv:
            paused = self.paused_seconds + (time.perf_counter() - self._paused_at
                                            if self.paused else 0.0)
            if self.paused:
                self._paused_at = time.perf_counter()
            out = {"idle": self.idle_seconds, "paused": paused, "interrupted": self.interrupted}
            self.idle_seconds = self.paused_seconds = 0.0
            self.interrupted = 0
            return out

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        self.thread.join(timeout=30)
        if self.finishes:  # trajectories left unfinished end too (an agent's session closes)
            for s in self._unfinished():
                self.turns.finish(s.state)
        if self.env_pool is not None:  # steps in flight finish into a stopped loop: dropped
            self.env_pool.shutdown(wait=False, cancel_futures=True)

    def _unfinished(self) -> list[_Sample]:
        with self.cv:
            return list(self.live.values())

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the generation loop failed: {self.error!r}") from self.error

    @property
    def idle(self) -> bool:
        """Not paused, and nothing to run: waiting for a submit."""
        return not self.paused and not self._has_work()

    # ------------------------------------------------------------------ the loop
    def _has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting) and not self.hold

    def _run(self) -> None:
        import torch

        torch._C.set_num_threads(self._threads)  # vLLM turns torch.set_num_threads off
        try:
            while True:
                with self.cv:
                    while True:
                        if self.stopped:
                            return
                        if self.pausing and self._ready_to_pause():
                            self._pause_now()
                        if not self.paused and self._has_work():
                            break
                        t0 = time.perf_counter()
                        self.cv.wait()
                        if not self.paused:
                            self.idle_seconds += time.perf_counter() - t0
                    if not self.hold:
                        for s in self.waiting:
                            self._admit(s)
                        self.waiting = []
                outputs = self.engine.step()
                with self.cv:
                    self.steps += 1
                    for out in outputs:
                        self._record(out)
                    self.cv.notify_all()
        except BaseException as e:  # surfaced by collect/pause in the caller's thread
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def _ready_to_pause(self) -> bool:
        """Draining: nothing in flight. Interrupting: nothing in flight that cannot be cut."""
        if self.pausing == "drain":
            return not self.running
        return not any(s.constraint for s in self.running.values())

    def _pause_now(self) -> None:
        if self.running:
            self.engine.abort(list(self.running))
            cut = list(self.running.values())
            self.running.clear()
            self.interrupted += len(cut)
            self.waiting[:0] = cut  # first in line when generation resumes
        self.paused, self.pausing = True, None
        self._paused_at = time.perf_counter()
        self.cv.notify_all()

    def _admit(self, s: _Sample) -> None:
        """Into the engine: the prompt, or (a cut sequence) the prompt and its tokens so far."""
        request_id = f"stream-{self.next_id}"
        self.next_id += 1
        seed = None if s.seed is None else (s.seed * 1_000_003 + s.segments) % 2**63
        limit = self.turn_tokens if s.turn_limit is None else s.turn_limit
        remaining = min(self.max_new_tokens - len(s.token_ids),
                        limit - (len(s.token_ids) - s.turn_start))
        self.engine.add_request(request_id, s.prompt + s.token_ids, seed, s.constraint,
                                max_tokens=remaining, greedy=self.greedy)
        s.segments += 1
        s.seen = 0
        self.running[request_id] = s

    def _record(self, out) -> None:
        """New tokens of one engine request (cumulative output) get the current version."""
        s = self.running.get(out.request_id)
        if s is None:
            return
        c = out.outputs[0]
        new = list(c.token_ids[s.seen:])
        s.token_ids += new
        s.logprobs += [step[tok].logprob for step, tok in zip(c.logprobs[s.seen:], new)]
        s.versions += [self.version] * len(new)
        s.mask += [1] * len(new)
        s.seen = len(c.token_ids)
        if not out.finished:
            return
        del self.running[out.request_id]
        s.finish_reason = str(c.finish_reason)
        if self.turns is not None:
            s.turns += 1
            self.env_pool.submit(self._step_env, s)
            return
        # a sequence cut by a sync: decode it whole (pieces decoded apart may join wrongly);
        # engines that do not detokenize as they go leave the text empty
        s.text = (c.text if s.segments == 1 and c.text else self.engine.decode(s.token_ids))
        self._finish(s)

    def _step_env(self, s: _Sample, first: bool = False) -> None:
        """In a worker thread: the environment's answer to the turn (first: the handler's
        `begin`), then the trajectory goes on (back in line for the engine) or ends."""
        try:
            result = (self.turns.begin(s.state) if first else self.turns.step(
                s.state, s.token_ids[s.turn_start:], s.finish_reason, s.logprobs[s.turn_start:]))
            problem = _result_problem(result)
            if problem:
                result = TurnResult(done=True, error=problem)
        except BaseException as e:  # the trajectory ends (never lost); the run goes on
            result = TurnResult(done=True, error=f"{type(e).__name__}: {e}")
        with self.cv:
            try:
                self._apply(s, result)
            except BaseException as e:  # a bug of ours: surfaced by collect/pause, not lost
                self.error = e
            self.cv.notify_all()

    def _apply(self, s: _Sample, result: TurnResult) -> None:
        """(Under the lock.) The environment's answer: the trajectory ends, or its observation
        is appended and it waits for the engine again."""
        if self.stopped:
            return
        for k, v in result.info.items():
            s.info[k] = s.info.get(k, 0) + v
        s.error, s.truncated, s.env_reward = result.error, result.truncated, result.reward
        if result.prompt is not None and not (result.done or result.error):
            s.prompt, s.token_ids, s.logprobs, s.versions, s.mask = result.prompt, [], [], [], []
            s.turn_start = 0
            if self.max_model_len is not None and len(s.prompt) >= self.max_model_len:
                s.error = (f"the prompt has {len(s.prompt)} tokens, no room within "
                           f"rollout.max_model_len={self.max_model_len}")
        room = self.max_new_tokens - len(s.token_ids) - len(result.observation)
        limit = result.next_turn_tokens
        if not (result.done or s.error) and (room < 1 or (limit is not None and limit < 1)):
            s.truncated, s.finish_reason = True, "length"  # no room for a model token
        if result.done or s.error or s.truncated:
            s.text = self.engine.decode(s.token_ids[s.turn_start:])  # the last model turn
            self._finish(s)
        else:
            s.token_ids += result.observation
            s.logprobs += [0.0] * len(result.observation)
            s.versions += [self.version] * len(result.observation)
            s.mask += [0] * len(result.observation)
            s.turn_start = len(s.token_ids)  # (segments go on counting: fresh seeds)
            s.turn_limit = limit
            self.waiting.append(s)

    def _finish(self, s: _Sample) -> None:
        if self.finishes:
            self.live.pop(id(s), None)
            self.turns.finish(s.state)
        slots = self.groups[s.group]
        slots[s.index] = s
        if all(x is not None for x in slots):
            del self.groups[s.group]
            self.done.append({"key": s.group, "completions": [
                {"token_ids": x.token_ids, "logprobs": x.logprobs, "versions": x.versions,
                 "finish_reason": x.finish_reason, "text": x.text,
                 **({"prompt_ids": x.prompt, "loss_mask": x.mask, "turns": x.turns, "info": x.info,
                     "truncated": x.truncated, "error": x.error, "env_reward": x.env_reward}
                    if self.turns else {})}
                for x in slots]})
