"""Checkpoints a run resumes from, bit for bit (sync mode, fp32).

`runs/<name>/checkpoints/step_N/` holds everything step N+1 depends on:
- `policy/` and `critic/`: the DeepSpeed engines (weights, optimizer, LR state), every rank's shard;
- `controller.json`: the step, the policy version, the prompt order and position, the base
  model's path and content hash (the reference model and the engines' starting point), the
  step's metrics line;
- `rng.pt`: the random states of the driver and of every actor;
- `config.yaml`: the resolved config.

A save writes `step_N.tmp/`, renames it to `step_N/`, then rewrites the `latest` marker (a
rename too): a crash at any point leaves the previous checkpoint and `latest` as they were.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rl.config import ConfigError, load_config
from rl.errors import last_line
from rl.run.tracks import actor_tracks
from rl.schema import Config

# keys a resumed run may change: how long it runs and what it writes, not what a step computes
RESUMABLE_CHANGES = ("trainer.total_steps", "trainer.checkpoint_every", "trainer.keep_checkpoints",
                     "trainer.max_restarts",
                     "run.loggers", "run.wandb_project", "run.timeline_steps", "run.log_samples",
                     "run.name", "run.output_dir")


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def model_digest(path: str) -> str:
    """sha256 of a model directory's config and weight files (names and bytes)."""
    digest = hashlib.sha256()
    root = Path(path)
    files = sorted(p for p in root.iterdir() if p.suffix in (".json", ".safetensors", ".bin")
                   and p.name != "generation_config.json")
    for p in files:
        digest.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def begin(run_dir: Path, step: int) -> Path:
    """An empty temporary directory for checkpoint `step`."""
    tmp = checkpoints_dir(run_dir) / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


STEP_DIR = re.compile(r"step_(\d+)$")


def published(root: Path) -> list[Path]:
    """The complete checkpoints step_N under `root`, oldest first."""
    found = [p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def point_latest(root: Path, name: str) -> None:
    marker = root / "latest.tmp"
    marker.write_text(name)
    marker.replace(root / "latest")


def commit(run_dir: Path, tmp: Path, step: int, keep: int) -> Path:
    """Publish a complete temporary checkpoint: rename it, then point `latest` at it; then keep
    only the newest `keep` checkpoints (0 keeps all), never the one `latest` names."""
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step}"
    old = None
    if final.exists():  # saved again (after a restart): `latest` may name it until the switch
        old = final.with_name(f"{final.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    point_latest(root, final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep > 0:
        for stale in published(root)[:-keep]:
            if stale != final:
                shutil.rmtree(stale, ignore_errors=True)
    return final


def supersede_newer(point: "ResumePoint") -> None:
    """Resuming from an older checkpoint abandons the newer ones: they move aside
    (step_N.superseded) and `latest` names the checkpoint the run continues from, so a later
    restart or --resume never jumps to the abandoned line of steps."""
    root = point.checkpoint.parent
    for newer in published(root):
        if int(STEP_DIR.match(newer.name).group(1)) > point.step:
            target = newer.with_name(f"{newer.name}.superseded")
            shutil.rmtree(target, ignore_errors=True)
            newer.rename(target)
    point_latest(root, point.checkpoint.name)


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass
class ResumePoint:
    run_dir: Path
    checkpoint: Path
    state: dict  # controller.json

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def driver(self) -> "DriverState":
        """The driver's part, as `save` wrote it."""
        return DriverState(**{f.name: self.state[f.name] for f in fields(DriverState)})


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = checkpoints_dir(run_dir) / "latest"
    if not marker.exists():
        return None
    path = checkpoints_dir(run_dir) / marker.read_text().strip()
    return path if (path / "controller.json").exists() else None


def newest_run_dir(cfg: Config) -> Path | None:
    """runs/<name> or its newest -2, -3, ... sibling (the one a plain run would have made last)."""
    base = Path(cfg.run.output_dir) / cfg.run.name
    found = [p for p in [base, *base.parent.glob(f"{base.name}-*")] if p.is_dir()
             and (p == base or p.name[len(base.name) + 1:].isdigit())]
    return max(found, key=lambda p: 1 if p == base else int(p.name[len(base.name) + 1:]),
               default=None)


def find_resume_point(cfg: Config, where: str | None) -> ResumePoint:
    """The checkpoint `--resume [where]` means: a checkpoint directory, a run directory's latest,
    or (no path) the latest of the newest run directory of the recipe's run.name."""
    if where is None:
        run_dir = newest_run_dir(cfg)
        if run_dir is None:
            raise ConfigError(f"--resume: no run directory {Path(cfg.run.output_dir) / cfg.run.name}"
                              f" to resume; start the run without --resume")
        where_text = f"the newest run of run.name={cfg.run.name!r} ({run_dir})"
    else:
        run_dir = Path(where)
        where_text = str(run_dir)
        if not run_dir.exists():
            raise ConfigError(f"--resume {where}: no such directory; give a run directory or one "
                              f"of its checkpoints/step_N")
    if (run_dir / "controller.json").exists():  # one checkpoint
        checkpoint, run_dir = run_dir, run_dir.parent.parent
    else:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise ConfigError(f"--resume: {where_text} has no complete checkpoint (set "
                              f"trainer.checkpoint_every to write them); start a new run")
    state = json.loads((checkpoint / "controller.json").read_text())
    return ResumePoint(run_dir.resolve(), checkpoint.resolve(), state)


def flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def check_resume(cfg: Config, point: ResumePoint, allow_change: bool) -> None:
    """Refuse a resume whose config changes what a step computes, or whose base model changed
    (before Ray starts; both are one-line errors)."""
    from dataclasses import asdict

    saved = load_config(str(point.checkpoint / "config.yaml"))
    if cfg.trainer.gradient_checkpointing == "auto":  # a resume keeps the choice its run made
        cfg.trainer.gradient_checkpointing = saved.trainer.gradient_checkpointing
    old, new = flat(asdict(saved)), flat(asdict(cfg))
    differ = [k for k in sorted(set(old) | set(new))
              if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES]
    if differ and not allow_change:
        shown = ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in differ[:6])
        raise ConfigError(f"--resume: the config differs from the checkpoint's in {shown}"
                          f"{' ...' if len(differ) > 6 else ''}; resume with the checkpoint's "
                          f"values, or pass --allow-config-change")
    model = point.driver.model_path
    if not Path(model).is_dir() or model_digest(model) != point.driver.model_sha256:
        raise ConfigError(f"--resume: the base model {model} that {point.checkpoint} was trained "
                          f"from is gone or changed (a wiped warm-up cache?); restore it, or start "
                          f"a new run")


class CheckpointError(RuntimeError):
    """A save failed; the previous checkpoint and `latest` are intact."""


def rng_state() -> dict:
    """This process's random states (python, numpy, torch)."""
    import random

    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass
class DriverState:
    """The driver's part of a checkpoint (controller.json, with the step and its metrics)."""
    policy_version: int
    prompts: dict  # PromptSet.state(): the prompt order and where it stands
    model_path: str  # the base model the run trains from
    model_sha256: str | None  # its content hash: a resume refuses a changed base model


def save(run_dir: Path, step: int, metrics: dict, cfg: Config, placement, state: DriverState,
         resume_command: str) -> dict:
    """Checkpoint `step` (after the step, before its line is logged): the placement's trainer
    ranks and every actor's random state, the config and `state`; returns its metrics. A
    failure raises CheckpointError naming `resume_command`."""
    import time

    import ray
    import torch

    from rl.config import to_yaml
    from rl.observe.progress import wait_with_progress

    t0 = time.perf_counter()
    try:
        tmp = begin(run_dir, step)
        wait_with_progress([w.save_checkpoint.remote(str(tmp)) for w in placement.trainers],
                           f"checkpoint step_{step}")
        actors = [a for _, a in actor_tracks(placement)]
        torch.save({"driver": rng_state(),
                    "actors": ray.get([a.rng_state.remote() for a in actors])}, tmp / "rng.pt")
        (tmp / "config.yaml").write_text(to_yaml(cfg))
        (tmp / "controller.json").write_text(json.dumps(
            {"step": step, **asdict(state), "metrics": metrics}))
        final = commit(run_dir, tmp, step, cfg.trainer.keep_checkpoints)
    except ray.exceptions.RayActorError:
        raise  # an actor died: the controller's recovery handles it
    except (OSError, RuntimeError, ray.exceptions.RayError) as e:
        last = latest_checkpoint(run_dir)
        cause = last_line(e)
        then = (f"the last complete one is {last.name}; resume with: {resume_command}" if last else
                "there is no complete checkpoint yet; start a new run")
        raise CheckpointError(f"checkpoint step_{step} failed ({cause}); {then}") from None
    return {"checkpoint/seconds": time.perf_counter() - t0,
            "checkpoint/bytes": float(directory_bytes(final))}


def restore(point: ResumePoint, placement, model_path: str, probe: list[int], prompts,
            engines: list | None = None) -> int:
    """Load a checkpoint into a placement whose trainers are initialized (trainer engines, the
    rollout engines at the saved policy version by a checked sync, every actor's random state)
    and into `prompts` (the order) and this process's random state; returns the policy version.
    engines: the rollout engines' builds, when the placement's start_rollout began them."""
    import ray
    import torch

    supersede_newer(point)
    directory = str(point.checkpoint)
    version = int(point.driver.policy_version)
    placement.init_rollout(model_path, version, engines)
    # both sides hold the base model until the checkpoint loads: the probe's noise floor
    placement.measure_probe_noise(probe)
    ray.get([w.load_checkpoint.remote(directory) for w in placement.trainers])
    if version > 0:  # the engines start from the base model: give them the saved policy
        placement.sync(version, probe)
    prompts.load_state(point.driver.prompts)
    rng = torch.load(point.checkpoint / "rng.pt", weights_only=False)
    actors = [a for _, a in actor_tracks(placement)]
    if len(rng["actors"]) != len(actors):
        raise CheckpointError(f"{point.checkpoint} has random states of {len(rng['actors'])} "
                              f"actors, this placement has {len(actors)}")
    ray.get([a.set_rng_state.remote(s) for a, s in zip(actors, rng["actors"])])
    set_rng_state(rng["driver"])
    return version
