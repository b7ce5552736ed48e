"""Where the two roles run: colocated (one actor per rank holds a trainer rank and an
engine) or disaggregated (a trainer pool and a rollout pool of their own actors).

Both placements give the controller the same surface: `trainers` (the DeepSpeed ranks, in rank
order), `engines` (the rollout actors), `sync(version)` ("make every engine policy `version`,
verified") and `stop()`.
"""
from __future__ import annotations

from rl.config import adapter_rank
from rl.errors import get_all
from rl.run.reserve import bundles, join_trainers, reserve, spawn, split_cores, split_roles
from rl.schema import Config


class Placement:
    trainers: list
    engines: list
    streaming = False  # the engines generate in loops of their own (async pipeline modes)
    colocated = False  # the engines are (some of) the trainers' actors
    pool = None  # the rl.run.pool.PlacementPool that `release` hands the actors back to, if any

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.pg = None

    def actors(self) -> list:
        """Every actor once (colocated, the trainers are the engines)."""
        return list({id(a): a for a in self.trainers + self.engines}.values())

    def rebind(self, cfg: Config) -> None:
        """Serve a new run of the same shape: what was measured or decided for the last run's
        config is forgotten (its models were freed by `release`)."""
        self.cfg, self.tolerance, self.engine_mode, self.streaming = cfg, None, None, False

    def release(self) -> None:
        """The run is done with the placement: back to its pool with its models freed, or
        stopped when it has none."""
        if self.pool is None:
            self.stop()
            return
        import ray

        try:
            ray.get([a.free_models.remote() for a in self.actors()], timeout=120)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            self.stop()  # an actor died or hangs: nothing to keep
            return
        self.pool.keep(self)

    @property
    def bucket_bytes(self) -> int:
        return int(self.cfg.sync.bucket_mb * 2**20)

    def start_rollout(self, model_path: str, version: int) -> list:
        """Start building the engines (holding `version`, the weights at model_path); returns
        the calls to hand to init_rollout. Engines that are actors of their own build while the
        trainers initialize."""
        return [e.init_rollout.remote(model_path, self.cfg.rollout, self.cfg.run.seed,
                                      version, self.cfg.env, adapter_rank(self.cfg))
                for e in self.engines]

    def init_rollout(self, model_path: str, version: int, started: list | None = None) -> None:
        """The engines, built (from the calls start_rollout began, or now)."""
        import ray

        # None: a colocated worker that holds no engine (a TP engine's rank > 0)
        modes = [m for m in ray.get(started or self.start_rollout(model_path, version)) if m]
        if self.engine_mode != modes[0]:  # said once per placement (checkpoint restores rebuild)
            self.engine_mode = modes[0]
            tp = self.cfg.rollout.tensor_parallel_size
            print(f"rollout engines: {len(modes)} x vLLM{f' at TP {tp}' if tp > 1 else ''}, "
                  f"model {modes[0]} (rollout.enforce_eager="
                  f"{self.cfg.rollout.enforce_eager})", flush=True)

    engine_mode: str | None = None  # "compiled" or "eager", once the engines are built

    tolerance: float | None = None  # the post-sync check's, once measured (measure_probe_noise)

    def sync(self, version: int, probe: list[int]) -> dict:
        raise NotImplementedError

    def probe_pairs(self, probe: list[int]) -> list[tuple[list[float], list[float]]]:
        """(trainer, engine) probe logprobs for every engine, weights as they are."""
        raise NotImplementedError

    def measure_probe_noise(self, probe: list[int]) -> dict:
        """While trainers and engines hold the same weights (the base model, before any sync):
        how far the engines score the probe from the trainer is their precision's own noise;
        the post-sync check's tolerance follows from it (weight_sync.verify.probe_tolerance)."""
        import ray

        from weight_sync.verify import max_abs_diff, probe_tolerance

        noise = max(max_abs_diff(t, e) for t, e in self.probe_pairs(probe))
        dtype = ray.get(self.engines[0].engine_dtype.remote())
        self.tolerance = probe_tolerance(self.cfg.trainer.dtype, dtype, self.cfg.sync.tolerance,
                                         noise)
        print(f"post-sync check: trainer {self.cfg.trainer.dtype}, engines {dtype}; the probe "
              f"scores {noise:.2g} apart on the same weights; tolerance {self.tolerance:g}"
              + (" (sync.tolerance)" if self.cfg.sync.tolerance is not None else ""), flush=True)
        return {"sync/probe_noise": noise, "sync/tolerance": self.tolerance}

    def sync_tolerance(self) -> float:
        """The post-sync check's tolerance: as measured at start-up, or, for a placement that
        never measured it (one driven by a test), the dtypes' uncalibrated default."""
        import ray

        from weight_sync.verify import probe_tolerance

        if self.tolerance is None:
            self.tolerance = probe_tolerance(self.cfg.trainer.dtype, ray.get(
                self.engines[0].engine_dtype.remote()), self.cfg.sync.tolerance)
        return self.tolerance

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.actors():
            ray.kill(w)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.trainers, self.engines, self.pg = [], [], None


class Colocated(Placement):
    """N actors, each one trainer rank + one engine; weights move by in-process copy. At
    rollout.tensor_parallel_size t > 1 an engine spans t actors and lives in the first
    (rl.run.colocated_worker): N / t engines."""

    colocated = True

    def __init__(self, cfg: Config):
        from rl.run.colocated_worker import ColocatedWorker

        super().__init__(cfg)
        r = cfg.ray
        self.pg = reserve(bundles(cfg), f"{r.num_workers} colocated workers")
        self.trainers = spawn(ColocatedWorker, self.pg, 0, r.num_workers, r.num_cpus_per_worker,
                              r.num_gpus_per_worker)
        self.engines = self.trainers[::cfg.rollout.tensor_parallel_size]
        join_trainers(self.trainers)

    def rebind(self, cfg: Config) -> None:
        super().rebind(cfg)
        self.engines = self.trainers[::cfg.rollout.tensor_parallel_size]

    def start_rollout(self, model_path: str, version: int) -> list:
        # every worker: those beside a TP engine's ranks > 0 learn which engine they write
        return [w.init_rollout.remote(model_path, self.cfg.rollout, self.cfg.run.seed,
                                      version, self.cfg.env, adapter_rank(self.cfg))
                for w in self.trainers]

    def probe_pairs(self, probe: list[int]) -> list[tuple[list[float], list[float]]]:
        pairs = get_all([w.probe.remote(probe) for w in self.trainers])  # a collective (ZeRO-3)
        return [pair for pair in pairs if pair[1] is not None]

    def sync(self, version: int, probe: list[int]) -> dict:
        from weight_sync.report import slowest

        tolerance = self.sync_tolerance()
        return slowest(get_all([w.sync_weights.remote(
            version, self.bucket_bytes, probe, tolerance, self.cfg.sync.exact,
            adapter_rank(self.cfg) > 0) for w in self.trainers])).metrics()


class Disaggregated(Placement):
    """N trainer actors and M engine actors; trainer rank 0 broadcasts each version to the
    engines over a gloo (CPU) / NCCL (GPU) group of 1 + M ranks."""

    def __init__(self, cfg: Config):
        import ray

        from rl.run.rollout_worker import RolloutWorker
        from rl.run.trainer_worker import TrainerWorker

        super().__init__(cfg)
        r = cfg.ray
        self.pg = reserve(bundles(cfg), f"{r.num_workers} trainer ranks + "
                                         f"{r.num_rollout_workers} rollout engines")
        trainer_cores = engine_cores = None
        if split_roles(cfg):  # both roles work at once: cores of their own
            trainer_cores, engine_cores = split_cores(
                r.num_workers * r.num_cpus_per_worker,
                r.num_rollout_workers * r.num_cpus_per_rollout_worker)
        self.trainers = spawn(TrainerWorker, self.pg, 0, r.num_workers, r.num_cpus_per_worker,
                              r.num_gpus_per_worker, cores=trainer_cores)
        # streaming (async pipeline modes), an engine takes submit/collect calls and a sync
        # while its generation loop runs
        self.engines = spawn(RolloutWorker, self.pg, r.num_workers, r.num_rollout_workers,
                             r.num_cpus_per_rollout_worker, r.num_gpus_per_rollout_worker,
                             concurrency=1 if cfg.pipeline.mode == "sync" else 4,
                             cores=engine_cores)
        self.streaming = False
        join_trainers(self.trainers)
        hosts = ray.get([a.hostname.remote() for a in self.trainers + self.engines])
        # engines on another host than the sender: buckets cross the network, no shared memory
        self.cross_host = float(len(set(hosts)) > 1)
        print("placement: " + ", ".join(
            [f"trainer rank {i} on {h}" for i, h in enumerate(hosts[:r.num_workers])]
            + [f"rollout engine {i} on {h}" for i, h in enumerate(hosts[r.num_workers:])]),
            flush=True)
        addr, port = ray.get(self.trainers[0].free_address.remote())
        size, timeout = 1 + len(self.engines), cfg.sync.timeout_s
        ray.get([self.trainers[0].join_sync_group.remote(addr, port, 0, size, timeout)]
                + [e.join_sync_group.remote(addr, port, 1 + i, size, timeout)
                   for i, e in enumerate(self.engines)])

    def init_rollout(self, model_path: str, version: int, started: list | None = None) -> None:
        """The engines; when they can take buckets in place (all with the same packed layout),
        tell the trainers, which then cut buckets from it."""
        import ray

        super().init_rollout(model_path, version, started)
        layouts = ray.get([e.pack_weights.remote() for e in self.engines])
        same = layouts[0] if all(x is not None and x == layouts[0] for x in layouts) else None
        ray.get([t.set_engine_layout.remote(same) for t in self.trainers])

    def start_streams(self, interruptible: bool) -> None:
        """Async pipeline modes: every engine generates in a loop of its own from now on; each
        sync pauses them, and only a verified one lets them go on."""
        import ray

        ray.get([e.start_stream.remote(interruptible) for e in self.engines])
        self.streaming = True

    def stop_streams(self) -> None:
        """Back to blocking generation (the final evaluation): the loops end, in-flight
        sequences are dropped."""
        import ray

        ray.get([e.stop_stream.remote() for e in self.engines])
        self.streaming = False

    def probe_pairs(self, probe: list[int]) -> list[tuple[list[float], list[float]]]:
        import ray

        trainer = get_all([t.trainer_logprobs.remote(probe) for t in self.trainers])[0]
        return [(trainer, lps) for lps in ray.get([e.score_tokens.remote(probe)
                                                    for e in self.engines])]

    def sync(self, version: int, probe: list[int]) -> dict:
        """Broadcast `version`, then check every engine's probe logprobs against the trainer's.
        Streaming, the engines pause to receive and resume only once their probe agrees (a
        failed check leaves them paused until a sync repairs them)."""
        import time

        import ray

        from weight_sync.report import SyncReport, broadcast
        from weight_sync.verify import check_logprobs

        t0 = time.perf_counter()
        sync = self.cfg.sync
        if adapter_rank(self.cfg):  # LoRA adapters: one small object, through Ray
            # rank 0's payload goes from its object store to the engines', not via the driver
            payloads = [t.adapter_payload.remote(sync.checksum) for t in self.trainers]
            received = get_all([e.load_adapter.remote(version, payloads[0])
                                for e in self.engines], peers=payloads)
            get_all(payloads[1:])  # the other ranks' part of the gather (None each)
            size = received[0].bytes
            sent = SyncReport(bytes=size, num_buckets=1, max_bucket_bytes=size,
                              ways={"in_place": False})
        else:
            sends = [t.send_weights.remote(version, self.bucket_bytes, sync.checksum)
                     for t in self.trainers]
            receives = [e.receive_weights.remote(version) for e in self.engines]
            # a failed sender fails the sync now (its receivers then time out, and the run
            # stops; a dead engine, which fails its sender, is raised as the death it is); a
            # receiver that finds a bad bucket still drains every bucket, so senders finish
            sent = get_all(sends, peers=receives)[0]
            received = get_all(receives)  # raises the first engine's WeightSyncError
        report = broadcast(sent, received, time.perf_counter() - t0)
        report.ways["cross_host"] = self.cross_host
        tp1 = self.cfg.rollout.tensor_parallel_size == 1  # (no exact check of TP slices yet)
        report.exact(*(self.check_exact() if sync.exact and sent.ways["in_place"] and tp1
                       else (0.0, 0)))
        tolerance = self.sync_tolerance()
        report.probe(max(check_logprobs(trainer, lps, tolerance, f"rollout engine {i}")
                         for i, (trainer, lps) in enumerate(self.probe_pairs(probe))), tolerance)
        if self.streaming:  # checked: generation goes on under the new version
            ray.get([e.resume_stream.remote() for e in self.engines])
        return report.metrics()

    def check_exact(self) -> tuple[float, int]:
        """Every engine's parameters against the bytes the trainer ranks sent in place, range
        by range (`weight_sync.exact`); raises ExactCheckError, else returns (seconds, the
        fewest ranges an engine checked)."""
        import time

        import ray

        t0 = time.perf_counter()
        ranges = [r for part in ray.get([t.exact_digests.remote() for t in self.trainers])
                  for r in part]
        checked = ray.get([e.check_exact.remote(ranges) for e in self.engines])
        return time.perf_counter() - t0, min(checked)


class EnginesOnly(Placement):
    """The rollout engines of cfg's placement and nothing else, started as a run starts them
    (the same number, resources, cores and seeds): for scoring a saved model (rl-eval), where
    a trainer would only cost start-up (DeepSpeed, the trainer ranks' process group)."""

    def __init__(self, cfg: Config):
        from rl.run.rollout_worker import RolloutWorker

        super().__init__(cfg)
        r = cfg.ray
        if cfg.placement == "colocated":
            # an engine per TP-size workers, on their cores (as Colocated runs them)
            count, cpus, gpus, cores = (r.num_workers // cfg.rollout.tensor_parallel_size,
                                        r.num_cpus_per_worker, r.num_gpus_per_worker, None)
            wanted = bundles(cfg)
        else:
            count, cpus, gpus = (r.num_rollout_workers, r.num_cpus_per_rollout_worker,
                                 r.num_gpus_per_rollout_worker)
            cores = split_cores(r.num_workers * r.num_cpus_per_worker,
                                count * cpus)[1] if split_roles(cfg) else None
            wanted = bundles(cfg)[r.num_workers:]
        self.pg = reserve(wanted, f"{count} rollout engines")
        self.engines = spawn(RolloutWorker, self.pg, 0, count, cpus, gpus, cores=cores)
        self.trainers = []


PLACEMENTS = {"colocated": Colocated, "disaggregated": Disaggregated}


def start_placement(cfg: Config) -> Placement:
    return PLACEMENTS[cfg.placement](cfg)
