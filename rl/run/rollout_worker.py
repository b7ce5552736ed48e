"""A rollout engine: one vLLM engine, the policy version its weights are, blocking or streaming
generation, and the receiving side of a disaggregated weight sync (`RolloutRole`), and the Ray
actor that is an engine alone (`RolloutWorker`)."""
from __future__ import annotations

from dataclasses import asdict

from rl.observe.timeline import traced
from rl.run.role import OnProcess, Process, Role, holds, lasting
from rollout.config import RolloutConfig


class RolloutRole(OnProcess):
    """One vLLM engine and the policy version its weights are; a part of a worker actor
    (rl.run.role)."""

    engine = None
    policy_version: int | None = None  # None: not loaded, or a failed sync left it stale
    direct_load = False  # syncs copy into the engine's parameters (else vLLM's reload)
    packed = None  # (layout digest, flat buffer) once the parameters live in one buffer
    stream = None  # rollout.stream.GenerationLoop in the asynchronous pipeline modes
    interruptible = True
    tp_shared = None  # at TP > 1: the ranks' weights (weight_sync.tp_shared), written by syncs
    receiver = None  # disaggregated: weight_sync.broadcast.BroadcastReceiver
    env = None  # envs.config.EnvConfig of a multi-turn run
    turns = None  # rl.run.turns' EnvTurns or AgentTurns: multi-turn, every generation
    agent_server = None  # envs.agent_server.AgentServer: agent programs' endpoint (kept)

    def __init__(self, process: Process):
        self.process = process

    @traced("init engine")
    def init_rollout(self, model_path: str, cfg: RolloutConfig, seed: int,
                     version: int = 0, env=None, lora_rank: int = 0) -> str:
        """A new engine holding `version` (the weights at model_path); returns how it runs the
        model: "compiled" or "eager" (rollout.enforce_eager). env: an envs.config.EnvConfig
        whose name makes every trajectory multi-turn (rl.run.turns). lora_rank > 0: the
        policy is the model with a LoRA adapter, which each sync replaces (`load_adapter`)."""
        self.env, self.turns = env, None
        if env is not None and env.name is not None:
            from transformers import AutoTokenizer

            from rl.run.agent_turns import turn_handler

            self.turns = turn_handler(env, AutoTokenizer.from_pretrained(model_path), cfg,
                                      self.spans, self.serve_agents)

        # an engine in this process tears down vLLM's process-wide parallel state when it goes:
        # let the old one go (`lasting` collects it) before the new one sets that state up
        self.close_engine()
        with lasting():
            from rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(model_path, cfg, seed=seed + self.rank, device=self.device,
                                     core_binding=self.tp_cores(cfg.tensor_parallel_size),
                                     lora_rank=lora_rank)
            self.policy_version, self.packed = version, None
            self.place_weights_directly()
        return "eager" if self.engine.eager else "compiled"

    def serve_agents(self):
        """This engine's OpenAI-compatible endpoint for agent programs (one port, kept for the
        actor's life)."""
        if self.agent_server is None:
            from envs.agent_server import AgentServer

            self.agent_server = AgentServer("policy")
        return self.agent_server

    def tp_cores(self, tp_size: int) -> str | None:
        """The cores of a TP engine's ranks on CPU, "0|1" (None: this actor's own cores split
        among them)."""
        return None

    def close_engine(self) -> None:
        """Stop the generation loop and shut the engine down (keeping a colocated trainer's
        process group: rollout.vllm_engine.VLLMEngine.close)."""
        import shutil

        from weight_sync.adapters import adapter_dir

        self.stop_stream()
        if self.engine is not None:
            self.engine.close()
        self.engine = self.policy_version = self.packed = None
        shutil.rmtree(adapter_dir(0).parent, ignore_errors=True)  # LoRA adapters it loaded

    def free_models(self) -> None:
        self.close_engine()

    def place_weights_directly(self) -> None:
        """Syncs copy each tensor into the engine's parameter when the engine keeps its weights
        as loaded and the model's names are known (`weight_sync.direct`); else vLLM reloads."""
        import logging

        from weight_sync.direct import DirectLoad
        from weight_sync.resharding import TPSpec

        config = self.engine.hf_config
        self.direct_load = False
        if self.engine.tp_size > 1:  # each rank's slice into its shared weights
            from weight_sync.tp_shared import TPSharedWeights

            self.tp_shared = TPSharedWeights.create(
                self.engine, TPSpec.from_hf_config(config, self.engine.tp_size))

            self.engine.set_weight_placer(self.tp_shared.write)
            self.direct_load = True
        elif self.engine.lora_rank and not self.engine.weights_in_place():
            return  # syncs move the adapter alone: the base stays as packed at load (cpu_linear)
        elif self.engine.weights_in_place() and DirectLoad.supports(config.model_type):
            spec = TPSpec.from_hf_config(config, tp_size=1)
            self.engine.set_weight_placer(DirectLoad(self.engine.parameters(), spec))
            self.direct_load = True
        else:
            logging.getLogger(__name__).warning(
                "engine %d: weight syncs go through vLLM's reload (model_type %r, weights in "
                "place: %s); rollout.cpu_linear=repack (or plain) with a Qwen2/Llama model "
                "copies them directly, ~4x faster", self.rank, config.model_type,
                self.engine.weights_in_place())

    def pack_weights(self) -> str | None:
        """Move the engine's parameters into one flat buffer so that disaggregated buckets can
        land in it (`weight_sync.in_place`); returns its layout, or None if the engine cannot
        take weights in place (packed CPU linears, an unknown model)."""
        from weight_sync.in_place import EngineLayout

        if not self.direct_load or self.device != "cpu":
            return None  # the sender cuts in-place buckets from CPU shared memory only
        if self.engine.tp_size > 1:  # each rank's weights are already in one buffer (tp_shared)
            from weight_sync.in_place import encode_layouts, layouts_digest

            ranks = range(self.engine.tp_size)
            layouts = [self.tp_shared.layouts[r] for r in ranks]
            self.packed = (layouts_digest(layouts), [self.tp_shared.memory[r] for r in ranks])
            return encode_layouts(layouts)
        params = self.engine.parameters()
        layout = EngineLayout.of(params)
        flat, views = layout.pack(params)
        self.engine.rebind_parameters(views)
        self.place_weights_directly()  # the placer must write to the packed copy
        self.packed = (layout.digest(), flat)
        self.layout = layout
        return layout.encode()

    @traced("verification")
    def check_exact(self, ranges: list) -> int:
        """Whether this engine's parameters hold the trainer's bytes, range by range
        (`weight_sync.exact`): raises ExactCheckError, else returns the ranges checked."""
        from weight_sync.exact import compare, engine_digests

        got = engine_digests(self.layout, self.engine.parameters(), ranges)
        return compare(ranges, got, f"rollout engine {self.rank}")

    def check_version(self, expected: int | None) -> None:
        if expected is not None and self.policy_version != expected:
            from weight_sync.transport import WeightSyncError

            raise WeightSyncError(
                f"rollout engine {self.rank} holds policy version {self.policy_version}, the "
                f"controller expected {expected}: a sync was missed or failed; refusing to "
                f"sample from a stale model")

    @traced("generate")
    def generate(self, prompts: list[list[int]], seeds: list[int],
                 constraints: list[dict | None] | None = None, n: int | None = None,
                 version: int | None = None, greedy: bool = False,
                 rows: list[dict] | None = None) -> dict:
        """{"groups": completions per prompt (as dicts), "stats": engine counters since last,
        "policy_version": the version that generated them}; checks `version` first. Multi-turn
        (rows: what each prompt's environments are reset with), the completions are whole
        trajectories (rollout.stream: loss_mask, turns, info, truncated, error)."""
        self.check_version(version)
        if self.turns is not None:
            groups = self._generate_turns(prompts, seeds, constraints, n, greedy, rows)
        else:
            groups = [[asdict(c) for c in group] for group in self.engine.generate(
                prompts, seeds=seeds, constraints=constraints, n=n, greedy=greedy)]
        return {"groups": groups, "stats": self.engine.take_stats(),
                "policy_version": self.policy_version}

    def _loop(self, n: int, greedy: bool = False):
        """A generation loop over this engine (multi-turn through self.turns when set)."""
        from rollout.stream import GenerationLoop

        cfg, env = self.engine.cfg, self.env
        multi = self.turns is not None
        return GenerationLoop(self.engine, self.policy_version, n, cfg.max_new_tokens,
                              turns=self.turns, greedy=greedy,
                              turn_tokens=env.turn_max_new_tokens if multi else None,
                              env_workers=env.num_workers if multi else 16)

    def _generate_turns(self, prompts, seeds, constraints, n, greedy, rows) -> list[list[dict]]:
        """Blocking multi-turn generation (sync pipeline, evaluation): a generation loop of its
        own until every trajectory is done."""
        if rows is None or len(rows) != len(prompts):
            raise ValueError("multi-turn generation needs each prompt's row (rows=)")
        keys = [("generate", i) for i in range(len(prompts))]
        constraints = constraints or [None] * len(prompts)
        loop = self._loop(n or self.engine.cfg.n, greedy)
        done: dict = {}
        try:
            for key, row in zip(keys, rows):
                self.turns.remember(key, row)
            loop.submit(list(zip(keys, prompts, seeds, constraints)))
            while len(done) < len(keys):
                for group in loop.collect(timeout_s=60.0):
                    done[group["key"]] = group["completions"]
        finally:
            loop.stop()
            for key in keys:
                self.turns.forget(key)
        return [done[key] for key in keys]

    # ---- streaming generation (the asynchronous pipeline modes)
    def start_stream(self, interruptible: bool) -> None:
        """Generate from here on in a loop of its own (rollout.stream), fed by `submit`; a sync
        pauses it (cutting the sequences in flight when interruptible) until `resume_stream`."""
        self.stop_stream()
        self.stream = self._loop(self.engine.cfg.n)
        self.interruptible = interruptible

    def stop_stream(self) -> None:
        """End the generation loop, leaving no request in the engine (sequences in flight are
        cut and dropped), so that blocking `generate` calls (evaluation) can use it again."""
        if self.stream is not None:
            if self.stream.error is None:
                self.stream.pause(interrupt=True)
            self.stream.stop()
            self.stream = None

    def submit(self, keys: list, prompts: list[list[int]], seeds: list[int],
               constraints: list[dict | None] | None = None,
               rows: list[dict] | None = None) -> None:
        """Groups to generate rollout.n samples of, each known by its key in what `collect`
        returns; multi-turn, rows: what each group's environments are reset with."""
        if self.turns is not None:
            if rows is None or len(rows) != len(keys):
                raise ValueError("multi-turn submit needs each group's row (rows=)")
            for key, row in zip(keys, rows):
                self.turns.remember(key, row)
        self.stream.submit(list(zip(keys, prompts, seeds, constraints or [None] * len(keys))))

    def collect(self, timeout_s: float = 5.0) -> dict:
        """{"groups": groups finished since the last call (each token with its version),
        "stats": engine counters, "times": seconds idle or paused and sequences cut since the
        last call (rollout.stream.GenerationLoop.take_times)}."""
        stream = self.stream  # a call in flight when the run stops the loop still returns
        groups = stream.collect(timeout_s)
        for group in groups if self.turns is not None else ():
            self.turns.forget(group["key"])
        return {"groups": groups, "stats": self.engine.take_stats(),
                "times": stream.take_times()}

    def stream_status(self) -> dict:
        """{"steps": scheduler steps run, "paused": bool, "idle": no work and not paused},
        taking nothing (for tests)."""
        stream = self.stream
        return {"steps": stream.steps, "paused": stream.paused, "idle": stream.idle}

    def resume_stream(self) -> None:
        """After a verified sync: generation goes on under the engine's new version."""
        if self.policy_version is None:
            raise RuntimeError(f"rollout engine {self.rank}: no verified policy version to resume "
                               f"generating with")
        if self.stream is not None:
            self.stream.resume(self.policy_version)

    @traced("sync")
    def receive_weights(self, version: int):
        """Disaggregated sync, receiving side (bucket size and checksum come with the layout);
        a weight_sync.report.SyncReport. Streaming, the loop pauses first and stays paused until
        `resume_stream`: nothing is generated with weights the probe has not checked."""
        import time

        from weight_sync.broadcast import BroadcastReceiver

        t0 = time.perf_counter()
        self.pause_for_sync()
        paused = time.perf_counter() - t0
        self.receiver = self.receiver or BroadcastReceiver(self.sync_group)
        report = self.receiver.receive(self.engine, version, self.direct_load, self.packed,
                                       self.tp_shared)
        self.policy_version = version
        report.phases["receive"] += paused  # the receive phase includes the stream's pause
        return report

    def pause_for_sync(self) -> None:
        """Streaming, the loop pauses (cutting what is in flight when interruptible); the engine
        holds no version until the sync's whole version has arrived and checked out."""
        if self.stream is not None:
            self.stream.pause(interrupt=self.interruptible)
        self.policy_version = None

    @traced("sync")
    def load_adapter(self, version: int, adapter: dict):
        """Adapter sync (trainer.lora with sync.lora=adapters), receiving side: `adapter` (what
        `TrainerRole.adapter_payload` made) checked against its checksum, written as PEFT's
        files to shared memory and loaded into the engine as policy `version`; a
        weight_sync.report.SyncReport. Streaming, the loop pauses first and stays paused until
        `resume_stream`, as for full weights."""
        import time

        from weight_sync.report import SyncReport

        t0 = time.perf_counter()
        self.pause_for_sync()
        nbytes = self.install_adapter(version, adapter)
        self.policy_version = version
        return SyncReport(bytes=nbytes, bytes_per_tp_rank=nbytes, ways={"direct_load": False},
                          phases={"receive": time.perf_counter() - t0})

    def install_adapter(self, version: int, adapter: dict) -> int:
        """Check `adapter` against its checksum, write it as PEFT's files to shared memory and
        load it into the engine as policy `version` (the previous one's files removed);
        returns its bytes."""
        import shutil

        from update.lora import write_adapter
        from weight_sync.adapters import adapter_dir, checksum
        from weight_sync.transport import WeightSyncError

        got = checksum(adapter["tensors"], adapter["checksum_name"])
        if got != adapter["checksum"]:
            raise WeightSyncError(f"rollout engine {self.rank}: the adapter of policy version "
                                  f"{version} arrived corrupted (checksum {got:#x}, sent "
                                  f"{adapter['checksum']:#x})")
        old = self.engine.lora
        path = adapter_dir(version)
        nbytes = write_adapter(path, adapter["tensors"], adapter["config"])
        self.engine.load_adapter(version, str(path))
        if old is not None and old.lora_path != str(path):  # (a retried sync: the same path)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return nbytes

    def engine_dtype(self) -> str:
        return self.engine.dtype

    @traced("verification")
    def score_tokens(self, token_ids: list[int]) -> list[float]:
        """The engine's logprob of each token after the first (no sampling)."""
        return self.engine.prompt_logprobs(token_ids)


@holds(rollout_role=RolloutRole)
class RolloutWorker(Role):
    """Disaggregated (or rl-eval): a rollout engine alone."""
