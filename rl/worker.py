"""Ray actors for the two roles: a trainer rank and a rollout engine.

Colocated, one actor holds both (they take turns on the same cores or device); disaggregated,
each role is an actor of its own. The roles only wire things together: the trainer, the engine
and the weight transport stay separate objects.
"""
from __future__ import annotations

import os
from dataclasses import asdict

from rl.timeline import Spans, traced
from rollout.config import RolloutConfig
from update.config import LossConfig, TrainerConfig


def cpu_binding(rank: int, world_size: int, num_cpus: int, first_core: int = 0) -> str:
    """The cores rank `rank` owns among num_cpus cores from first_core, as 'a-b' for
    VLLM_CPU_OMP_THREADS_BIND."""
    per_rank = max(1, num_cpus // world_size)
    first = first_core + (rank * per_rank) % num_cpus
    return f"{first}-{first + per_rank - 1}"


def phase_seconds(stats, prefix: str = "") -> dict:
    """sync/<prefix><phase>_seconds for each timed phase of a transfer (gather, wire, load...)."""
    return {f"sync/{prefix}{phase}_seconds": s for phase, s in stats.seconds.items()}


def release_free_memory() -> None:
    """Hand memory the process freed back to the system: tcmalloc (ray.cpu_malloc) and glibc
    both keep freed pages for reuse, so a kept actor would go on holding a freed KV cache."""
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "MallocExtension_ReleaseFreeMemory"):  # tcmalloc
        libc.MallocExtension_ReleaseFreeMemory()
    elif hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)


class Role:
    """Process set-up shared by both roles: threads and core pinning on CPU, the device name."""

    def __init__(self, rank: int, world_size: int, cores: tuple[int, int] | None = None):
        """cores: (first, count) of the machine's cores this role's ranks share (a
        disaggregated run whose roles work at the same time); None: all of them."""
        import torch

        self.rank, self.world_size = rank, world_size
        if not torch.cuda.is_available():
            first_core, num_cpus = cores or (0, os.cpu_count() or 1)
            threads = max(1, num_cpus // world_size)
            # vLLM makes torch.set_num_threads a no-op once it binds threads: set them first.
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)
            cores = cpu_binding(rank, world_size, num_cpus, first_core)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
            # Pin now, not only once vLLM binds its threads: unpinned ranks that spin in
            # DeepSpeed's shared-memory collectives made warm-up steps up to 4x slower.
            first, last = map(int, cores.split("-"))
            os.sched_setaffinity(0, range(first, last + 1))
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        from update.trainer import device_name

        self.device = device_name()
        self.sync_group = None
        self.spans = Spans()  # for the run's timeline.json

    def rng_state(self) -> dict:
        """This process's random states, for a checkpoint (rl.checkpoint saves them)."""
        from rl.checkpoint import rng_state

        return rng_state()

    def set_rng_state(self, state: dict) -> None:
        from rl.checkpoint import set_rng_state

        set_rng_state(state)

    def free_models(self) -> None:
        """Drop this role's models (the placement is kept for a later run, rl.placement's
        PlacementPool); the next init_trainer / init_rollout builds new ones."""
        import gc

        self.spans = Spans()  # recording, as in a new actor
        gc.collect()
        release_free_memory()

    def drain_spans(self, keep_recording: bool = True) -> list:
        """The spans recorded since the last call; stop recording when told to."""
        self.spans.enabled = keep_recording
        return self.spans.drain()

    def hostname(self) -> str:
        import socket

        return socket.gethostname()

    def free_address(self) -> tuple[str, int]:
        """(this node's IP, a free port), for a process group's rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_sync_group(self, host: str, port: int, rank: int, world_size: int,
                        timeout_s: float) -> None:
        """Join the weight-sync group (trainer rank 0 is its rank 0, engines follow)."""
        import ray

        from weight_sync.collective import CollectiveGroup

        # gloo binds to the address Ray reaches this node by: host names need not resolve
        self.sync_group = CollectiveGroup(host, port, rank, world_size, self.device, timeout_s,
                                          bind_address=ray.util.get_node_ip_address())


    # ------------------------------------------------------------------ physical limits
    def measure_memcpy(self, nbytes: int, repeats: int = 3) -> float:
        """Best seconds to copy nbytes between two warm buffers on this worker's cores/device:
        the floor under an in-process (colocated) sync of that many bytes."""
        import time

        import torch

        src = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.zeros_like(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            if self.device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    def measure_broadcast(self, nbytes: int, chunk_bytes: int, repeats: int = 3) -> float:
        """Best seconds to broadcast nbytes in chunk_bytes pieces from sync-group rank 0 into warm
        buffers, all pieces in flight at once: the link's floor under a disaggregated sync. Every
        member of the sync group calls this together."""
        import time

        import torch

        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)  # touched: warm
        group = self.sync_group
        group.broadcast(buf[:1]).wait()  # connections up before timing
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            works = [group.broadcast(buf[o:o + chunk_bytes]) for o in range(0, nbytes, chunk_bytes)]
            for w in works:
                w.wait()
            best = min(best, time.perf_counter() - t0)
        return best


class TrainerRole(Role):
    """One DeepSpeed rank: the policy trainer (and the critic's, for PPO)."""

    trainer = critic = None
    # the trainer ranks' shared-memory bucket slots (weight_sync.node_buckets), made on the
    # first sync; False when the ranks span several machines, train on GPUs, or /dev/shm is
    # too small
    shared_slots = None
    engine_layout = None  # the engines' packed layout (weight_sync.in_place), when they have one

    def set_engine_layout(self, encoded: str | None) -> None:
        from weight_sync.in_place import EngineLayout

        self.engine_layout = None if encoded is None else EngineLayout.decode(encoded)

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        from update.trainer import init_distributed

        init_distributed(self.rank, self.world_size, master_addr, master_port)

    @traced("init trainer")
    def init_trainer(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                     grad_accum: int, temperature: float = 1.0, norm_length: float = 1.0,
                     critic: bool = False) -> None:
        """The policy trainer (and the critic's, for PPO); replaces any earlier ones."""
        from update.trainer import PolicyTrainer

        self.trainer = self.critic = None  # release the previous engines first (warm-up -> RL)
        self.trainer = PolicyTrainer(model_path, cfg, loss_cfg, grad_accum, temperature,
                                     norm_length)
        if critic:
            from update.critic import ValueTrainer

            self.critic = ValueTrainer(model_path, cfg, loss_cfg, grad_accum)

    def free_models(self) -> None:
        # the shared-memory slots are decided again for the next trainer
        self.trainer = self.critic = self.shared_slots = self.engine_layout = None
        super().free_models()

    @traced("prepare")
    def prepare(self, micro_batches: list[dict]) -> list[dict]:
        """Old (and reference) logprobs, and critic values, of each micro-batch."""
        out = self.trainer.prepare(micro_batches)
        if self.critic is not None:
            for item, values in zip(out, self.critic.prepare(micro_batches)):
                item.update(values)
        return out

    @traced("update")
    def train(self, micro_batches: list[dict], counts) -> dict:
        metrics = self.trainer.train_step(micro_batches, counts)
        if self.critic is not None:
            metrics.update(self.critic.train_step(micro_batches, counts))
        return metrics

    @traced("warm-up")
    def sft(self, micro_batches: list[dict], num_tokens: float) -> dict:
        return self.trainer.sft_step(micro_batches, num_tokens)

    @traced("verification")
    def trainer_logprobs(self, token_ids: list[int]) -> list[float]:
        """The trainer's logprobs of a probe (a collective under ZeRO-3: every rank calls)."""
        return self.trainer.sequence_logprobs(token_ids)

    def measure_gather(self, bucket_bytes: int, repeats: int = 3) -> float:
        """Best seconds to gather every parameter from ZeRO-3, bucket by bucket, with no
        consumer: the trainer's own floor under any sync (every rank calls this together)."""
        import time

        from weight_sync.buckets import iter_full_weights

        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in iter_full_weights(self.trainer.module, bucket_bytes, {}):
                pass
            best = min(best, time.perf_counter() - t0)
        return best

    @traced("sync")
    def send_weights(self, version: int, bucket_bytes: int, checksum: str,
                     corrupt_bucket: int | None = None) -> dict:
        """Disaggregated sync, sending side: every rank helps assemble each bucket (shared
        memory, or a gather), rank 0 broadcasts it."""
        import time

        from weight_sync.transport import BroadcastTransport

        t0 = time.perf_counter()
        engine = None
        if self.engine_layout is not None:
            from weight_sync.resharding import TPSpec

            engine = (self.engine_layout, TPSpec.from_hf_config(self.trainer.module.config, 1))
        transport = BroadcastTransport(self.sync_group, bucket_bytes, checksum, self.shared_slots,
                                       engine)
        stats = transport.send(self.trainer.module, version, corrupt_bucket)
        self.shared_slots = transport.shared
        return {"sync/send_seconds": time.perf_counter() - t0, "sync/bytes": stats.bytes,
                "sync/num_buckets": stats.num_buckets,
                "sync/max_bucket_bytes": stats.max_bucket_bytes,
                "sync/in_place": float(transport.in_place), **phase_seconds(stats, "send_")}

    @traced("checkpoint")
    def save_checkpoint(self, directory: str) -> None:
        """This rank's shards of the policy (and critic) engines into directory/policy|critic."""
        self.trainer.save_checkpoint(directory, "policy")
        if self.critic is not None:
            self.critic.save_checkpoint(directory, "critic")

    @traced("load checkpoint")
    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory, "policy")
        if self.critic is not None:
            self.critic.load_checkpoint(directory, "critic")

    @traced("save")
    def save_hf(self, directory: str) -> None:
        self.trainer.save_hf(directory)


class RolloutRole(Role):
    """One vLLM engine and the policy version its weights are."""

    engine = None
    policy_version: int | None = None  # None: not loaded, or a failed sync left it stale
    direct_load = False  # syncs copy into the engine's parameters (else vLLM's reload)
    packed = None  # (layout digest, flat buffer) once the parameters live in one buffer
    stream = None  # rollout.stream.GenerationLoop in the asynchronous pipeline modes
    interruptible = True

    @traced("init engine")
    def init_rollout(self, model_path: str, cfg: RolloutConfig, seed: int,
                     version: int = 0) -> str:
        """A new engine holding `version` (the weights at model_path); returns how it runs the
        model: "compiled" or "eager" (rollout.enforce_eager)."""
        import gc

        from rollout.vllm_engine import VLLMEngine

        # an engine in this process tears down vLLM's process-wide parallel state when it goes:
        # let the old one go before the new one sets that state up
        self.close_engine()
        gc.collect()
        self.engine = VLLMEngine(model_path, cfg, seed=seed + self.rank, device=self.device)
        self.policy_version, self.packed = version, None
        self._place_weights_directly()
        return "eager" if self.engine.eager else "compiled"

    def close_engine(self) -> None:
        """Stop the generation loop and shut the engine down (keeping a colocated trainer's
        process group: rollout.vllm_engine.VLLMEngine.close)."""
        self.stop_stream()
        if self.engine is not None:
            self.engine.close()
        self.engine = self.policy_version = self.packed = None

    def free_models(self) -> None:
        self.close_engine()
        super().free_models()

    def _place_weights_directly(self) -> None:
        """Syncs copy each tensor into the engine's parameter when the engine keeps its weights
        as loaded and the model's names are known (`weight_sync.direct`); else vLLM reloads."""
        import logging

        from weight_sync.direct import DirectLoad
        from weight_sync.resharding import TPSpec

        config = self.engine.hf_config
        self.direct_load = False
        if self.engine.weights_in_place() and DirectLoad.supports(config.model_type):
            spec = TPSpec.from_hf_config(config, tp_size=1)
            self.engine.set_weight_placer(DirectLoad(self.engine.parameters(), spec))
            self.direct_load = True
        else:
            logging.getLogger(__name__).warning(
                "engine %d: weight syncs go through vLLM's reload (model_type %r, weights in "
                "place: %s); rollout.cpu_linear=repack (or plain) with a Qwen2/Llama model "
                "copies them directly, ~4x faster", self.rank, config.model_type,
                self.engine.weights_in_place())

    def measure_reload(self, model_path: str, repeats: int = 3) -> float:
        """Best seconds for the engine to load a checkpoint's tensors already in memory: the
        engine's own floor under any sync. Leaves the engine stale (it holds that checkpoint)."""
        import time
        from pathlib import Path

        from safetensors.torch import load_file

        weights = [item for f in sorted(Path(model_path).glob("*.safetensors"))
                   for item in load_file(f).items()]
        self.policy_version = None
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.engine.load_weights(weights)
            best = min(best, time.perf_counter() - t0)
        return best

    def pack_weights(self) -> str | None:
        """Move the engine's parameters into one flat buffer so that disaggregated buckets can
        land in it (`weight_sync.in_place`); returns its layout, or None if the engine cannot
        take weights in place (packed CPU linears, an unknown model)."""
        from weight_sync.in_place import EngineLayout

        if not self.direct_load or self.device != "cpu":
            return None  # the sender cuts in-place buckets from CPU shared memory only
        params = self.engine.parameters()
        layout = EngineLayout.of(params)
        flat, views = layout.pack(params)
        self.engine.rebind_parameters(views)
        self._place_weights_directly()  # the placer must write to the packed copy
        self.packed = (layout.digest(), flat)
        return layout.encode()

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
                 version: int | None = None, greedy: bool = False) -> dict:
        """{"groups": completions per prompt (as dicts), "stats": engine counters since last,
        "policy_version": the version that generated them}; checks `version` first."""
        self.check_version(version)
        out = self.engine.generate(prompts, seeds=seeds, constraints=constraints, n=n,
                                   greedy=greedy)
        return {"groups": [[asdict(c) for c in group] for group in out],
                "stats": self.engine.take_stats(), "policy_version": self.policy_version}

    # ---- streaming generation (the asynchronous pipeline modes)
    def start_stream(self, interruptible: bool) -> None:
        """Generate from here on in a loop of its own (rollout.stream), fed by `submit`; a sync
        pauses it (cutting the sequences in flight when interruptible) until `resume_stream`."""
        from rollout.stream import GenerationLoop

        self.stop_stream()
        cfg = self.engine.cfg
        self.stream = GenerationLoop(self.engine, self.policy_version, cfg.n, cfg.max_new_tokens)
        self.interruptible = interruptible

    def stop_stream(self) -> None:
        """End the generation loop, leaving no request in the engine (sequences in flight are
        cut and dropped), so that blocking `generate` calls (evaluation) can use it again."""
        if self.stream is not None:
            if self.stream.error is None:
                self.stream.pause(interrupt=True)
            self.stream.stop()
            self.stream = None

    def submit(self, groups: list[tuple]) -> None:
        """(key, prompt ids, seed, constraint) per group, to generate rollout.n samples of."""
        self.stream.submit(groups)

    def collect(self, timeout_s: float = 5.0) -> dict:
        """{"groups": groups finished since the last call (each token with its version),
        "stats": engine counters, "times": seconds idle or paused and sequences cut since the
        last call (rollout.stream.GenerationLoop.take_times)}."""
        stream = self.stream  # a call in flight when the run stops the loop still returns
        groups = stream.collect(timeout_s)
        return {"groups": groups, "stats": self.engine.take_stats(),
                "times": stream.take_times()}

    def stream_status(self) -> dict:
        """{"steps": scheduler steps run, "paused": bool}, taking nothing (for tests)."""
        return {"steps": self.stream.steps, "paused": self.stream.paused}

    def resume_stream(self) -> None:
        """After a verified sync: generation goes on under the engine's new version."""
        if self.policy_version is None:
            raise RuntimeError(f"rollout engine {self.rank}: no verified policy version to resume "
                               f"generating with")
        if self.stream is not None:
            self.stream.resume(self.policy_version)

    @traced("sync")
    def receive_weights(self, version: int) -> dict:
        """Disaggregated sync, receiving side (bucket size and checksum come with the layout).
        Streaming, the loop pauses first and stays paused until `resume_stream`: nothing is
        generated with weights the probe has not checked."""
        import time

        from weight_sync.transport import BroadcastTransport

        t0 = time.perf_counter()
        if self.stream is not None:
            self.stream.pause(interrupt=self.interruptible)
        self.policy_version = None  # until the whole version has arrived and checked out
        stats = BroadcastTransport(self.sync_group, 0).receive(
            self.engine.load_weights, version, keeps_views=not self.direct_load,
            packed=self.packed)
        self.engine.weights_changed()  # in-place buckets bypass load_weights
        self.policy_version = version
        return {"sync/receive_seconds": time.perf_counter() - t0, "sync/bytes": stats.bytes,
                "sync/direct_load": float(self.direct_load), **phase_seconds(stats, "receive_")}

    def engine_dtype(self) -> str:
        return self.engine.dtype

    @traced("verification")
    def score_tokens(self, token_ids: list[int]) -> list[float]:
        """The engine's logprob of each token after the first (no sampling)."""
        return self.engine.prompt_logprobs(token_ids)


class TrainerWorker(TrainerRole):
    """Disaggregated: a trainer rank alone."""


class RolloutWorker(RolloutRole):
    """Disaggregated: a rollout engine alone."""


class ColocatedWorker(TrainerRole, RolloutRole):
    """One trainer rank and one rollout engine in one process, taking turns."""

    # the engines' weights in shared memory, written in place by the trainer ranks
    # (weight_sync.shared_weights); None: not decided yet, False: not possible here
    shared_weights = None

    def init_rollout(self, *args, **kwargs) -> str:
        mode = super().init_rollout(*args, **kwargs)
        self.shared_weights = None  # a new engine: decided again on the next sync
        return mode

    def free_models(self) -> None:
        self.shared_weights = None
        super().free_models()

    @traced("sync")
    def sync_weights(self, version: int, bucket_bytes: int, probe: list[int],
                     tolerance: float | None = None) -> dict:
        """Make this rank's engine the trainer's weights (collective over the trainer ranks),
        then verify them on a probe (tolerance None: the dtypes' uncalibrated default)."""
        import time

        from weight_sync.verify import check_logprobs, probe_tolerance

        tolerance = probe_tolerance(self.trainer.cfg.dtype, self.engine.dtype, tolerance)

        t0 = time.perf_counter()
        self.policy_version = None
        if self.shared_weights is None:
            self.shared_weights = self._share_engine_weights()
        if self.shared_weights:
            stats = self._write_shared_weights()
        else:
            stats = self._load_buckets(version, bucket_bytes)
        seconds = time.perf_counter() - t0
        with self.spans.span("verification"):
            trainer_lps = self.trainer.sequence_logprobs(probe)
            t1 = time.perf_counter()
            engine_lps = self.engine.prompt_logprobs(probe)
            t2 = time.perf_counter()
        diff = check_logprobs(trainer_lps, engine_lps, tolerance, f"rank {self.rank}")
        self.policy_version = version
        return {"sync/seconds": seconds, "sync/probe_trainer_seconds": t1 - seconds - t0,
                "sync/probe_engine_seconds": t2 - t1, "sync/bytes": stats.bytes,
                "sync/num_buckets": stats.num_buckets, "sync/max_bucket_bytes": stats.max_bucket_bytes,
                "sync/logprob_max_abs_diff": diff, "sync/tolerance": tolerance,
                "sync/direct_load": float(self.direct_load),
                "sync/shared_weights": float(bool(self.shared_weights)), **phase_seconds(stats)}

    def _share_engine_weights(self):
        """Move the engines' weights into one shared copy when they keep their weights as loaded
        and the trainer is on CPU (every rank decides alike: same config and model)."""
        from weight_sync.resharding import TPSpec
        from weight_sync.shared_weights import SharedWeights

        if not self.direct_load or self.device != "cpu":
            return False
        spec = TPSpec.from_hf_config(self.engine.hf_config, tp_size=1)
        shared = SharedWeights.create(self.engine.parameters(), spec)
        if shared is None:
            return False
        self.engine.rebind_parameters(shared.views)
        self._place_weights_directly()  # the placer must write to the shared copy too
        return shared

    def _write_shared_weights(self):
        import time

        from weight_sync.buckets import SyncStats, full_numel, tied_head_alias

        module = self.trainer.module
        stats = SyncStats()
        t0 = time.perf_counter()
        self.shared_weights.write(module, tied_head_alias(module))
        self.engine.weights_changed()
        stats.add_time("write", time.perf_counter() - t0)
        stats.bytes = sum(full_numel(p) * p.element_size() for p in module.parameters())
        return stats

    def _load_buckets(self, version: int, bucket_bytes: int):
        from weight_sync.transport import LocalTransport

        transport = LocalTransport(bucket_bytes, self.shared_slots, keeps_views=not self.direct_load)
        transport.send(self.trainer.module, version)
        stats = transport.receive(self.engine.load_weights, version)
        self.shared_slots = transport.shared
        return stats

    def probe(self, probe: list[int]) -> tuple[list[float], list[float]]:
        """(trainer, engine) logprobs of the probe, without syncing first (for tests)."""
        return self.trainer.sequence_logprobs(probe), self.engine.prompt_logprobs(probe)
