"""A run's plan: what each device holds, whether it fits, the smallest change that makes it fit,
and a step's time, from the resolved config, the model's shape and the hardware."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from rl.plan.hardware import Hardware
from rl.plan.memory import EngineSide, TrainerSide, engine_memory, trainer_memory
from rl.plan.shape import ModelShape
from rl.plan.timing import (StepShape, rollout_seconds, speculation, step_seconds, sync_seconds,
                            update_seconds)
from rl.config import adapter_rank, grad_accum_steps
from rl.schema import Config

GIB = 2 ** 30
CPU_MAX_NUM_SEQS = 256  # vLLM-CPU's max_num_seqs (rollout.vllm_cpu.CPU_MAX_NUM_SEQS)
GPU_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs for the LLM class
# CPU: a process's own resident memory beside its tensors: a trainer rank's (torch, DeepSpeed,
# transformers: 535-587 MiB with the tiny model, benchmarks/plan_check.py), and what an
# in-process vLLM engine adds (the quickstart's colocated worker, docs/planning.md); GPU: the
# CUDA context and the allocator's slack
CPU_TRAINER_PROCESS = 0.5 * GIB
CPU_ENGINE_PROCESS = 1.25 * GIB
CPU_DRIVER = 1.5 * GIB  # the driver and Ray's own processes
GPU_CONTEXT = 1.0 * GIB
HEADROOM = 0.95  # of a device's memory, what a plan may fill


@dataclass
class Cluster:
    hardware: Hardware
    nodes: int = 1
    devices_per_node: int = 1  # GPUs per node; CPU: 1 (a node's RAM)


@dataclass
class Plan:
    config: Config
    shape: ModelShape
    cluster: Cluster
    prompt_tokens: int
    trainer: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    devices: dict = field(default_factory=dict)  # device kind -> (bytes needed, capacity)
    time: dict = field(default_factory=dict)
    fits: bool = True
    short: str = ""  # the first thing that does not fit
    notes: list = field(default_factory=list)  # choices made for the config (auto settings)

    def process_rss(self) -> float:
        """What a trainer rank's process holds (memory/trainer_peak_rss_mib measures it): on CPU
        the process itself beside its tensors, colocated with its engine in the same process;
        on a GPU, the GPU memory of the device."""
        if self.cluster.hardware.gpu:
            return next(iter(self.devices.values()))[0]
        if self.config.placement == "colocated":
            return CPU_TRAINER_PROCESS + CPU_ENGINE_PROCESS + self.trainer["peak"] + (
                self.engine["peak"])
        return CPU_TRAINER_PROCESS + self.trainer["peak"]

    def to_dict(self) -> dict:
        return {"model": {"params": self.shape.params(), **vars(self.shape)},
                "hardware": self.cluster.hardware.to_dict(), "nodes": self.cluster.nodes,
                "devices_per_node": self.cluster.devices_per_node,
                "prompt_tokens": self.prompt_tokens, "trainer": self.trainer,
                "engine": self.engine, "devices": self.devices, "time": self.time,
                "process_rss": self.process_rss(), "fits": self.fits, "short": self.short,
                "notes": self.notes}


def trainer_side(cfg: Config, shape: ModelShape, prompt_tokens: int,
                 gpu: bool = False) -> TrainerSide:
    t, a = cfg.trainer, cfg.algorithm
    lora = adapter_params(cfg, shape)
    per_rank = cfg.rollout.prompts_per_step * cfg.rollout.n // (
        cfg.ray.num_workers * a.num_mini_batches)
    return TrainerSide(
        ranks=cfg.ray.num_workers, zero_stage=t.zero_stage, dtype=t.dtype,
        bf16_mode=t.bf16_mode, micro_batch=max(1, min(t.micro_batch_size, per_rank)),
        prompt_tokens=prompt_tokens, response_tokens=cfg.rollout.max_new_tokens,
        group_size=cfg.rollout.n, share_prompts=t.enable_prompt_sharing and cfg.rollout.n > 1,
        checkpointing=t.checkpointing(), whole_model_max=t.zero3_whole_model_max,
        release=t.zero3_release_params, reference=a.loss.kl_coef > 0 and t.lora is None,
        critic=a.critic, lora_params=lora, gpu=gpu)


def adapter_params(cfg: Config, shape: ModelShape) -> int:
    """The LoRA adapters' parameters (trainer.lora), 0 without LoRA."""
    t = cfg.trainer
    return shape.lora_params(t.lora.rank, list(t.lora.target_modules)) if t.lora else 0


def engine_side(cfg: Config, gpu: bool, prompt_tokens: int) -> EngineSide:
    r = cfg.rollout
    return EngineSide(tp=r.tensor_parallel_size, dtype=r.dtype if r.dtype != "auto" else "bfloat16",
                      max_model_len=r.max_model_len, block_size=r.block_size,
                      max_num_seqs=GPU_MAX_NUM_SEQS if gpu else CPU_MAX_NUM_SEQS,
                      kv_cap_bytes=None if gpu else r.kv_cache_gib * GIB,
                      memory_fraction=r.gpu_memory_utilization,
                      seq_tokens=prompt_tokens + r.max_new_tokens,
                      kept_weights=not gpu and r.cpu_linear_mode(
                          lora_adapter=adapter_rank(cfg) > 0) == "repack")


def engines(cfg: Config) -> int:
    if cfg.placement == "colocated":
        return max(1, cfg.ray.num_workers // cfg.rollout.tensor_parallel_size)
    return cfg.ray.num_rollout_workers


def device_needs(cfg: Config, trainer: dict, engine: dict, cluster: Cluster) -> dict:
    """Bytes each kind of device must hold, and what it has: on GPUs a device per trainer rank
    (colocated: with its share of an engine) and per engine TP rank; on a CPU node every process
    of the run in its RAM."""
    hw = cluster.hardware
    capacity = hw.memory_bytes * HEADROOM
    if hw.gpu:
        if cfg.placement == "colocated":
            return {"gpu (trainer rank + engine rank)": (
                GPU_CONTEXT + trainer["peak"] + engine["peak"], capacity)}
        return {"gpu (trainer rank)": (GPU_CONTEXT + trainer["peak"], capacity),
                "gpu (engine rank)": (GPU_CONTEXT + engine["peak"], capacity)}
    ranks = cfg.ray.num_workers
    ranks_e = engines(cfg) * cfg.rollout.tensor_parallel_size
    total = (ranks * (trainer["peak"] + CPU_TRAINER_PROCESS)
             + ranks_e * (engine["peak"] + CPU_ENGINE_PROCESS) + CPU_DRIVER)
    return {"cpu node RAM (every process)": (total, capacity * cluster.nodes)}


def devices_wanted(cfg: Config) -> int:
    if cfg.placement == "colocated":
        return cfg.ray.num_workers
    return cfg.ray.num_workers + cfg.ray.num_rollout_workers * cfg.rollout.tensor_parallel_size


def make_plan(cfg: Config, shape: ModelShape, cluster: Cluster,
              prompt_tokens: int | None = None, acceptance: float | None = None) -> Plan:
    """The plan of cfg; prompt_tokens defaults to the longest a prompt may be (max_model_len -
    max_new_tokens), so that a plan that fits holds for any data."""
    hw = cluster.hardware
    p = prompt_tokens if prompt_tokens is not None else (
        cfg.rollout.max_model_len - cfg.rollout.max_new_tokens)
    plan = Plan(cfg, shape, cluster, p)
    plan.trainer = trainer_memory(shape, trainer_side(cfg, shape, p, hw.gpu))
    plan.engine = engine_memory(shape, engine_side(cfg, hw.gpu, p), hw.memory_bytes)
    plan.devices = device_needs(cfg, plan.trainer, plan.engine, cluster)
    short = [(k, need, cap) for k, (need, cap) in plan.devices.items() if need > cap]
    have = cluster.nodes * cluster.devices_per_node
    if hw.gpu and devices_wanted(cfg) > have:
        plan.fits, plan.short = False, (f"the run asks for {devices_wanted(cfg)} GPUs, the "
                                        f"cluster has {have}")
    elif short:
        kind, need, cap = short[0]
        item = max((k for k in plan.trainer if k != "peak"), key=plan.trainer.get)
        plan.fits = False
        plan.short = (f"{kind}: needs {need / GIB:.1f} GiB, has {cap / GIB:.1f} GiB "
                      f"(largest item: trainer {item}, {plan.trainer[item] / GIB:.1f} GiB)")
    if plan.engine["max_sequences"] < 1:
        plan.fits = False
        seq = min(p + cfg.rollout.max_new_tokens, cfg.rollout.max_model_len)
        plan.short = plan.short or f"the engine's KV cache holds no sequence of {seq} tokens"
    plan.time = timing(cfg, shape, hw, plan, acceptance)
    return plan


def timing(cfg: Config, shape: ModelShape, hw: Hardware, plan: Plan,
           acceptance: float | None) -> dict:
    a = cfg.algorithm
    nodes = plan.cluster.nodes  # a CPU node's engine ranks, or trainer ranks, share its cores
    engine_ranks = engines(cfg) * cfg.rollout.tensor_parallel_size
    s = StepShape(samples=cfg.rollout.prompts_per_step * cfg.rollout.n, group_size=cfg.rollout.n,
                  prompt_tokens=plan.prompt_tokens, response_tokens=cfg.rollout.max_new_tokens,
                  engines=engines(cfg), tp=cfg.rollout.tensor_parallel_size,
                  engine_dtype=engine_side(cfg, hw.gpu, plan.prompt_tokens).dtype,
                  trainer_dtype=cfg.trainer.dtype, trainer_ranks=cfg.ray.num_workers,
                  micro_batches=grad_accum_steps(cfg) * a.num_mini_batches,
                  scoring_passes=int(not a.one_pass()) + int(plan.trainer.get("reference", 0) > 0)
                  + int(a.critic), updates=a.ppo_epochs, recompute=cfg.trainer.checkpointing(),
                  critic=a.critic,
                  adapter_params=adapter_params(cfg, shape) if adapter_rank(cfg) > 0 else 0,
                  zero_stage=cfg.trainer.zero_stage,
                  engines_per_device=1 if hw.gpu else -(-engine_ranks // nodes),
                  ranks_per_device=1 if hw.gpu else -(-cfg.ray.num_workers // nodes))
    r = rollout_seconds(shape, hw, s, plan.engine["max_sequences"], plan.engine["kv_per_token"])
    u = update_seconds(shape, hw, s, cfg.trainer.enable_prompt_sharing and cfg.rollout.n > 1)
    across = cfg.placement == "disaggregated" and nodes > 1
    sy = sync_seconds(shape, s, (hw.inter_link if across else hw.intra_link) * hw.sync_utilization,
                      hw.sync_overhead)
    out = {"rollout": r, "update": u, "sync": sy,
           "utilization": {"train": hw.train_utilization, "decode": hw.decode_utilization,
                           "prefill": hw.prefill_utilization, "sync": hw.sync_utilization},
           "step": {m: step_seconds(r["seconds"], u["seconds"], sy["seconds"], m)
                    for m in ("sync", "one_step", "fully_async")}}
    if acceptance is not None:
        k = cfg.rollout.num_speculative_tokens
        out["speculation"] = speculation(acceptance, k, r["decode_step"], 0.0, r["bound"])
    return out


def with_changes(cfg: Config, changes: dict) -> Config:
    """A copy of cfg with dotted keys set (trainer.zero_stage: 3)."""
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        *path, last = key.split(".")
        node = new
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    return new


def candidate_fixes(cfg: Config) -> list[dict]:
    """Single changes, cheapest first: recompute, smaller micro-batches, a higher ZeRO stage,
    module by module, a smaller KV cache or engine share, more TP, LoRA, more trainer ranks."""
    from update.config import LoraConfig

    t, r = cfg.trainer, cfg.rollout
    out = []
    if not t.checkpointing():
        out.append({"trainer.gradient_checkpointing": True})
    mb = t.micro_batch_size
    while mb > 1:
        mb //= 2
        out.append({"trainer.micro_batch_size": mb})
    for stage in range(t.zero_stage + 1, 4):
        out.append({"trainer.zero_stage": stage})
    if t.zero_stage == 3 and t.zero3_whole_model_max:
        out.append({"trainer.zero3_whole_model_max": 0})
    if r.kv_cache_gib > 0.25:
        out.append({"rollout.kv_cache_gib": max(0.25, r.kv_cache_gib / 4)})
    if r.gpu_memory_utilization > 0.2:
        out.append({"rollout.gpu_memory_utilization": round(r.gpu_memory_utilization / 2, 2)})
    if r.cpu_linear_mode(lora_adapter=adapter_rank(cfg) > 0) == "repack":  # CPU engines only
        out.append({"rollout.cpu_linear": "plain"})  # the linears once, not beside a packed copy
    if r.dtype == "float32":
        out.append({"rollout.dtype": "bfloat16"})
    if t.dtype == "float32":
        out.append({"trainer.dtype": "bfloat16"})
    out.append({"rollout.tensor_parallel_size": r.tensor_parallel_size * 2})
    if t.lora is None:
        out.append({"trainer.lora": LoraConfig()})
        # syncs move the adapter alone: a CPU engine keeps its base packed, once
        out.append({"trainer.lora": LoraConfig(), "sync.lora": "adapters"})
    out.append({"ray.num_workers": cfg.ray.num_workers * 2})
    return out


def smallest_fix(cfg: Config, shape: ModelShape, cluster: Cluster,
                 prompt_tokens: int | None = None) -> dict | None:
    """The first single change (candidate_fixes' order) after which the plan fits; else changes
    combined, each the one that lowers the largest device's need most, up to five (a 1.5B at
    ZeRO-0 in 20 GiB takes LoRA, micro-batches of 1, bf16 both sides and ZeRO-3); None when
    nothing found fits."""
    for change in candidate_fixes(cfg):
        if make_plan(with_changes(cfg, change), shape, cluster, prompt_tokens).fits:
            return change
    def fullest(plan: Plan) -> float:
        return max(need / cap for need, cap in plan.devices.values())

    chosen: dict = {}
    for _ in range(5):
        options = [dict(chosen, **ch) for ch in candidate_fixes(with_changes(cfg, chosen))
                   if not set(ch) & set(chosen) - {"trainer.micro_batch_size"}]
        if not options:
            return None
        plans = [(make_plan(with_changes(cfg, ch), shape, cluster, prompt_tokens), ch)
                 for ch in options]
        best, chosen = min(plans, key=lambda pc: fullest(pc[0]))
        if best.fits:
            return chosen
    return None


def choose_checkpointing(cfg: Config, shape: ModelShape, cluster: Cluster,
                         prompt_tokens: int | None = None) -> tuple[bool, str]:
    """trainer.gradient_checkpointing=auto: (recompute, why). Recompute only when the plan
    without it does not fit: its speed where memory allows, its memory where it must."""
    plan = make_plan(with_changes(cfg, {"trainer.gradient_checkpointing": False}), shape, cluster,
                     prompt_tokens)
    need, cap = max(plan.devices.values(), key=lambda nc: nc[0] / nc[1])
    activations = plan.trainer["activations"] / GIB
    if plan.fits:
        return False, (f"a micro-batch's activations ({activations:.2f} GiB) fit beside the rest "
                       f"(the plan needs {need / GIB:.1f} of {cap / GIB:.1f} GiB)")
    return True, f"without recompute the plan does not fit ({plan.short})"


def resolve_auto(cfg: Config, shape: ModelShape, cluster: Cluster,
                 prompt_tokens: int | None = None) -> str:
    """Settle trainer.gradient_checkpointing=auto in cfg (in place, before any trainer reads
    it); the line that says which and why, or "" when it was set."""
    if cfg.trainer.gradient_checkpointing != "auto":
        return ""
    choice, why = choose_checkpointing(cfg, shape, cluster, prompt_tokens)
    cfg.trainer.gradient_checkpointing = choice
    return f"trainer.gradient_checkpointing=auto -> {str(choice).lower()}: {why}"


def fix_text(change: dict) -> str:
    """The change as rl-train's key=value overrides (a LoRA section as its YAML mapping)."""
    def show(v):
        if hasattr(v, "rank"):
            return (f"{{rank: {v.rank}, alpha: {v.alpha:g}, target_modules: "
                    f"[{', '.join(v.target_modules)}]}}")
        return str(v).lower() if isinstance(v, bool) else v
    return " ".join(f"{k}={show(v)}" for k, v in change.items())
