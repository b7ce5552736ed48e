"""A DeepSpeed (ZeRO-1/2/3) policy trainer: token logprobs, policy-loss steps, SFT steps.

Batches arrive as micro-batches of padded tensors (see `MicroBatch` keys below). Every loss is
normalized by the token/sequence count of the *global* batch, then multiplied by
world_size * grad_accum so that DeepSpeed's own averaging (over ranks and accumulation steps)
leaves exactly the global mean: the update does not depend on how the batch was split.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import torch

from update.config import LossConfig, TrainerConfig
from update.forward import (allow_recompute_with_cache, check_model_class, full_layout, is_shared,
                            part_logprobs, response_parts, response_targets, token_logprobs)
from update.losses import (BatchCounts, LossInputs, add_metrics, nll_loss, old_logprob_metrics,
                           policy_loss)
from update.mlp import lean_gated_mlps

# MicroBatch keys (rl.algo.batch.collate): the tokens in one of two layouts (update.forward: full,
# or shared prompts); response-only token-level [B, R] float tensors: response_mask (1 on
# response tokens), advantages, old_logprobs, rollout_logprobs, and when used ref_logprobs,
# values, returns.

# Largest |shared-prompt - full| logprob of the start-up check (float32) for the shared layout
# to be used: measured 0-2.5e-5 on Qwen2/Llama; a forward that mishandles the cache is off by
# whole nats.
SHARED_PROMPT_TOLERANCE = 1e-4


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the trainer's process group (gloo on CPU, NCCL on GPU)."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    import deepspeed

    if device_name() == "cpu":
        load_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if device_name() == "cuda" else "gloo")


def load_shm_comm_op() -> None:
    """Load DeepSpeed's CPU shared-memory comm op (a JIT build, cached in torch's extensions
    directory) before deepspeed.init_distributed asks for it, under `jit_build_lock`; DeepSpeed
    then takes the loaded module from its cache."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    from torch.utils.cpp_extension import _get_build_directory

    path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja_first_path(path, sys.executable)
    try:
        with jit_build_lock(Path(_get_build_directory(builder.name, verbose=False))):
            builder.load()
    finally:
        os.environ["PATH"] = path


def ninja_first_path(path: str, executable: str) -> str:
    """PATH with the interpreter's own directory first when it holds a `ninja` (the pip package
    DeepSpeed installs): torch builds with the first `ninja` on PATH, and two ninja versions (a
    venv's 1.13 and a system's 1.11) cannot read each other's build log, so each rebuilt the op
    after the other (21 s on 2 cores, several times a suite: processes with and without an
    activated venv)."""
    here = str(Path(executable).parent)
    if not (Path(here) / "ninja").exists():
        return path
    return os.pathsep.join([here, *[p for p in path.split(os.pathsep) if p and p != here]])


@contextmanager
def jit_build_lock(build_dir: Path):
    """Hold an exclusive lock on `build_dir`'s JIT build and clear torch's own lock file there.
    Torch's lock (cpp_extension's FileBaton: a file that exists while a process builds or
    checks the build) stays behind when that process is killed, and then every later load
    waits for it forever: a run killed during its start-up hung every run after it in
    init_distributed. This lock is flock's, which dies with its holder, and every loader here
    holds it, so a torch lock file found while holding it is such a leftover."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".rlstack-lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def ds_config(cfg: TrainerConfig, world_size: int, grad_accum: int, train: bool = True,
              release_unit: int | None = None) -> dict:
    """release_unit: ZeRO-3 gathers the model module by module and releases what it gathered
    once used (`release_unit`), the largest decoder layer's parameter count."""
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": cfg.micro_batch_size * grad_accum * world_size,
        "zero_optimization": {
            # ZeRO-1/2 shard optimizer state and gradients, which a frozen model (the reference)
            # has none of: DeepSpeed refuses those stages without an optimizer
            "stage": cfg.zero_stage if train or cfg.zero_stage == 3 else 0,
            # 0: shard every parameter, even tiny ones (DeepSpeed's default keeps < 1e5 whole).
            "stage3_param_persistence_threshold": cfg.zero3_persistence_threshold,
            # ZeRO-3's own linear (on by default) replaces torch.nn.functional.linear process-wide
            # and computes x @ W.t() with matmul: for the strided hidden states that
            # logits_to_keep slices it falls back to a batched matmul that copies the weight once
            # per sample (on the 49k-vocabulary head of SmolLM2, over half the step on CPU)
            "memory_efficient_linear": False,
        },
        "bf16": {"enabled": cfg.dtype == "bfloat16" and cfg.bf16_mode == "weights"},
        "torch_autocast": {"enabled": cfg.dtype == "bfloat16" and cfg.bf16_mode == "autocast",
                           "dtype": "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if release_unit is not None:
        config["zero_optimization"].update(
            # DeepSpeed keeps a gathered weight that is used again within this many elements
            # (default 1e9: a smaller model stays gathered from its forward into its backward)
            stage3_max_reuse_distance=0,
            stage3_prefetch_bucket_size=release_unit,  # about one decoder layer ahead
            stage3_max_live_parameters=3 * release_unit,
            # gradients reduced a layer at a time (DeepSpeed's default buffer, 5e8 elements,
            # takes a smaller model's whole gradient, and keeps those pages)
            reduce_bucket_size=release_unit)  # and zero3_linears (zero_engine)
    if train:
        config["gradient_clipping"] = cfg.grad_clip
        config["zero_allow_untested_optimizer"] = True  # a client torch AdamW: no JIT op build
    return config


def save_engine(engine, directory: str, tag: str, trained_only: bool = False) -> None:
    """trained_only: leave frozen parameters out (LoRA: the base is the model the run loads)."""
    engine.save_checkpoint(directory, tag=tag, save_latest=False,
                           exclude_frozen_parameters=trained_only)


def load_engine(engine, directory: str, tag: str, trained_only: bool = False) -> None:
    """Weights, optimizer and LR state exactly as saved (a resumed step is bit-identical);
    trained_only: a checkpoint without the frozen parameters (which the engine holds already)."""
    path, _ = engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                     load_lr_scheduler_states=True,
                                     load_module_strict=not trained_only)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {directory}/{tag}")


class Body(torch.nn.Module):
    """The model, run with an `anchor` in front where one is given (see EngineModule): a zero
    scalar that requires grad, made 1 and multiplied into the input embeddings (exactly:
    x * 1.0 == x). It is the first thing in the graph, so that its gradient is the last one
    computed, after every weight's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, anchor: torch.Tensor | None, *args, mb: dict | None = None,
                score=None, **kwargs):
        handle = None
        if anchor is not None:
            one = anchor * 0 + 1
            embed = self.model.get_input_embeddings()
            handle = embed.register_forward_hook(lambda _m, _i, out: out * one)
        try:
            if mb is None:
                return self.model(*args, **kwargs)
            return score(response_parts(self.model, mb))
        finally:
            if handle is not None:
                handle.remove()


class EngineModule(torch.nn.Module):
    """What each DeepSpeed engine wraps: the model (`.model`), called once per micro-batch.

    `engine(mb=mb, score=f)` scores a micro-batch's responses: f maps the [B, R, V] logits, in
    pieces (update.forward.response_parts), to one tensor, e.g. the token logprobs, so that the
    logits are never joined and ZeRO-3 sees one output (a leaf module with two outputs reduced
    its gradients after the first one's backward); the shared-prompt layout runs the model
    twice, prompts then responses on their cache; other arguments go to the
    model's own forward. Inside one call of this module the two runs are one forward to ZeRO-3,
    which starts its step at each forward of the module it wraps: calling the model twice
    directly began a new step mid-forward, so ZeRO-3's record of module order never held from
    one step to the next and it fetched every parameter on demand (the quickstart's update 2.5x
    ZeRO-2's).

    `whole` (ZeRO-3; `is_whole`): the model is one ZeRO-3 leaf module
    (`deepspeed.utils.set_z3_leaf_module`), gathered whole in one collective for the forward and
    again for the backward, its gradients reduced once the backward has left it, instead of a
    gather and DeepSpeed's hooks around every module (~60 per forward of a 2-layer model; the
    quickstart's update 0.13 -> 0.10 s, ZeRO-2 0.09). DeepSpeed reduces a leaf's gradients when
    the gradients of its inputs are computed; token ids have none, so the `Body`'s anchor is
    that input."""

    def __init__(self, model: torch.nn.Module, whole: bool = False):
        super().__init__()
        self.body = Body(model)
        self.whole = whole
        if whole:
            from deepspeed.utils import set_z3_leaf_module

            set_z3_leaf_module(self.body, True)

    @property
    def model(self) -> torch.nn.Module:
        return self.body.model

    def forward(self, *args, **kwargs):
        anchor = None  # needed only where a backward reduces the leaf's gradients
        if self.whole and torch.is_grad_enabled():
            anchor = torch.zeros((), device=self.model.device, requires_grad=True)
        return self.body(anchor, *args, **kwargs)


HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _block_names(module: torch.nn.Module) -> set[str]:
    """The class names of a HF model's decoder layers (its `_no_split_modules`)."""
    return {name for m in module.modules() for name in getattr(m, "_no_split_modules", None) or []}


def zero3_linears(model: torch.nn.Module) -> None:
    """In place: each decoder layer's linears compute through DeepSpeed's ZeRO-3 linear, which
    saves the weight Parameter for the backward (gathered again there), where torch's linear
    saves the view W.t() that holds the gathered weight's memory after ZeRO-3 has released it
    (with it a forward of bench-100m ended holding every weight: +0.7 GB a rank). Instead of
    DeepSpeed's `memory_efficient_linear`, which replaces torch.nn.functional.linear in the
    whole process: the colocated engine's linears and the head too, whose strided input
    (logits_to_keep) sends its matmul to a batched copy of the weight per sample (on SmolLM2's
    49k-vocabulary head, over half the step on CPU). The head keeps torch's linear: its
    backward comes right after its forward."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    blocks = _block_names(model)
    for layer in model.modules():
        if type(layer).__name__ in blocks:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    m.forward = partial(_zero3_linear, m, zero3_linear_wrap)


def _zero3_linear(m: torch.nn.Linear, wrap, x: torch.Tensor) -> torch.Tensor:
    return wrap(x, m.weight, m.bias)


def gather_units(module: torch.nn.Module) -> list[tuple[torch.nn.Module, list]]:
    """(module, the parameters to gather before it runs): each decoder layer whole (the HF
    models' `_no_split_modules`), and every other module with weights of its own (embeddings,
    final norm, head, a value head)."""
    blocks = _block_names(module)

    def walk(m: torch.nn.Module) -> list:
        if type(m).__name__ in blocks:
            return [(m, list(m.parameters()))]
        own = list(m.parameters(recurse=False))
        return ([(m, own)] if own else []) + [u for c in m.children() for u in walk(c)]

    return walk(module)


@contextmanager
def scoring(engine):
    """The callable to run forwards that are not a training step's with (the post-sync probe,
    the old-logprob pass, every forward of the frozen reference): the engine itself under ZeRO
    0-2; under ZeRO-3, `engine.module` outside ZeRO-3's hooks. ZeRO-3 records the order in
    which a step uses the modules and from then on prefetches along that record; a forward of
    another shape through its hooks replaced the record or broke it (a probe is shorter than
    the step it is checked against), and each training step then fetched on demand (the
    quickstart's update 0.17 s instead of 0.13).

    Outside the hooks, a model gathered whole for training (`EngineModule.whole`) runs on a
    full copy of its weights gathered in one collective, once per context (`gathered_weights`,
    `torch.func.functional_call`; the tiny model's probe 7 ms instead of 18 with a gather per
    layer); another gathers each decoder layer just before it runs and releases it after
    (`deepspeed.zero.GatheredParameters`)."""
    module = engine.module
    if engine.zero_optimization_stage() != 3:
        yield engine
        return
    import deepspeed
    from deepspeed.runtime.torch_autocast import autocast_if_enabled

    saved = {m: [getattr(m, name) for name in HOOK_DICTS] for m in module.modules()}
    full_copy = z3_whole(module)
    units = {} if full_copy else dict(gather_units(module))
    handles, gathered, weights = [], {}, {}

    def gather(m, *_):
        gathered[m] = deepspeed.zero.GatheredParameters(units[m], modifier_rank=None)
        gathered[m].__enter__()

    def release(m, *_):
        gathered.pop(m).__exit__(None, None, None)

    def on_full_weights(*args, **kwargs):
        if not weights:  # once per context: the weights do not change inside it
            weights.update(gathered_weights(dict(module.named_parameters())))
        return torch.func.functional_call(module, weights, args, kwargs)

    try:
        for m in saved:
            for name in HOOK_DICTS:
                setattr(m, name, OrderedDict())
        for m in units:
            handles += [m.register_forward_pre_hook(gather), m.register_forward_hook(release)]
        with autocast_if_enabled(engine):  # what the engine's own forward runs under
            yield on_full_weights if full_copy else module
    finally:
        for h in handles:
            h.remove()
        for ctx in gathered.values():  # a forward that raised
            ctx.__exit__(None, None, None)
        for m, dicts in saved.items():
            for name, d in zip(HOOK_DICTS, dicts):
                setattr(m, name, d)


def gathered_weights(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Full copies of ZeRO-3 parameters, on every rank, from one all-gather per dtype (where
    `GatheredParameters` runs one per parameter). DeepSpeed keeps rank r's part of a parameter
    as elements [r * s, (r + 1) * s) of the flattened parameter, padded at the end."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out = {}
    for dtype in {p.ds_tensor.dtype for p in params.values()}:
        group = [(name, p) for name, p in params.items() if p.ds_tensor.dtype == dtype]
        local = torch.cat([p.ds_tensor.view(-1) for _, p in group])
        n = local.numel()
        flat = torch.empty(world * n, dtype=dtype, device=local.device)
        dist.all_gather_into_tensor(flat, local)
        shards = flat.view(world, n)
        offset = 0
        for name, p in group:
            size = p.ds_tensor.numel()
            full = shards[:, offset:offset + size].reshape(-1)[:p.ds_numel]
            out[name] = full.view(p.ds_shape)
            offset += size
    return out


def is_whole(model: torch.nn.Module, cfg: TrainerConfig, world: int) -> bool:
    """Whether ZeRO-3 on `world` ranks gathers `model` whole (EngineModule): within
    `trainer.zero3_whole_model_max` parameters, or on one rank (no partition to save memory
    with: module by module only adds DeepSpeed's hooks), unless the key is 0. The frozen
    reference follows the same rule: its full copy costs what the policy's does."""
    if cfg.zero_stage != 3 or cfg.zero3_whole_model_max == 0:
        return False
    return world == 1 or sum(p.numel() for p in model.parameters()) <= cfg.zero3_whole_model_max


def release_unit(model: torch.nn.Module, cfg: TrainerConfig, world: int) -> int | None:
    """ds_config's release_unit for `model`: its largest gather unit (a decoder layer) where
    ZeRO-3 gathers it module by module and `trainer.zero3_release_params` is on, else None."""
    if cfg.zero_stage != 3 or not cfg.zero3_release_params or is_whole(model, cfg, world):
        return None
    return max(sum(p.numel() for p in ps) for _, ps in gather_units(model))


def zero_engine(model: torch.nn.Module, cfg: TrainerConfig, world: int, grad_accum: int,
                optimizer: torch.optim.Optimizer | None = None):
    """The DeepSpeed engine of `model` (in an EngineModule, gathered whole or module by module
    by `is_whole`); without an optimizer, a frozen model's (the reference)."""
    import deepspeed

    train = optimizer is not None
    unit = release_unit(model, cfg, world) if train else None
    if unit is not None:
        zero3_linears(model)
    engine, *_ = deepspeed.initialize(
        model=EngineModule(model, whole=is_whole(model, cfg, world)), optimizer=optimizer,
        config=ds_config(cfg, world, grad_accum, train=train, release_unit=unit))
    return engine


def z3_whole(module: torch.nn.Module) -> bool:
    from deepspeed.utils import z3_leaf_module

    return isinstance(module, EngineModule) and z3_leaf_module(module.body)


def _to(mb: dict, key: str, dev):
    return mb[key].to(dev) if mb.get(key) is not None else None


def shares_prompts(cfg: TrainerConfig, config, recompute: bool) -> bool:
    """Whether shared-prompt micro-batches run as such (else they are expanded to the full
    layout): on when configured and a small float32 model of this architecture scores a
    made-up batch alike both ways, under recompute its gradients too
    (update.forward.check_model_class; every rank decides alike, from the same config)."""
    import logging

    if not cfg.enable_prompt_sharing:
        return False
    diff, error = check_model_class(config, recompute)
    if diff <= SHARED_PROMPT_TOLERANCE:
        return True
    logging.getLogger(__name__).warning(
        "trainer.enable_prompt_sharing: %s scores shared prompts %s, so each sample runs "
        "its own prompt (slower when n > 1)", config.model_type,
        f"with an error ({error})" if error else f"off by {diff:.3g}")
    return False


class PolicyTrainer:
    """The policy on a DeepSpeed engine, plus a frozen reference engine when KL is used.

    With `cfg.lora` the policy is the base model with LoRA adapters (update.lora): only they
    train and enter the optimizer and checkpoints, and the reference is the same module with
    the adapters switched off (no second model)."""

    peft = None  # the PeftModel handle of a LoRA policy
    _merged = None  # with LoRA: the merged model of the current weights, once a sync built it

    def __init__(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                 grad_accum: int, temperature: float = 1.0, norm_length: float = 1.0,
                 seed: int = 0):
        """`seed` draws the LoRA adapters' A, the same on every rank (rl-train: run.seed)."""
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        self.cfg, self.loss_cfg, self.temperature = cfg, loss_cfg, temperature
        self.norm_length = norm_length
        self.world_size = dist.get_world_size()
        self.grad_accum = grad_accum
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model_path = model_path
        if cfg.lora is not None:
            from update.lora import add_adapters

            self.peft = add_adapters(model, cfg.lora, seed)  # in place: `model` holds the adapters
        lean_gated_mlps(model)  # one tensor fewer kept per MLP, the same numbers (update.mlp)
        if cfg.checkpointing():
            model.gradient_checkpointing_enable()
            allow_recompute_with_cache(model)  # shared prompts under recompute (update.forward)
            if self.peft is not None:  # a frozen embedding: checkpointed layers need a grad
                model.enable_input_require_grads()
        model.config.use_cache = False
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                      weight_decay=cfg.weight_decay)
        self.engine = zero_engine(model, cfg, self.world_size, grad_accum, optimizer)
        self.ref = None
        # LoRA: the reference is the policy with its adapters off
        self.base_reference = loss_cfg.kl_coef > 0 and self.peft is not None
        if loss_cfg.kl_coef > 0 and self.peft is None:
            ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            ref_model.requires_grad_(False)
            self.ref = zero_engine(ref_model, cfg, self.world_size, grad_accum)
            self.ref.eval()
        self.share_prompts = shares_prompts(cfg, self.module.config, cfg.checkpointing())

    @property
    def module(self) -> torch.nn.Module:
        """The HF model (its parameters ZeRO-sharded under stage 3)."""
        return self.engine.module.model

    def _forward(self, engine, mb: dict, entropy: bool = False):
        """(token logprobs [B, R], entropy [B, R] or None) of the responses under `engine` (a
        DeepSpeed engine, or what `scoring` gives)."""
        from update.losses import entropy_from_logits

        if is_shared(mb) and not self.share_prompts:
            mb = full_layout(mb)
        targets, t = response_targets(mb), self.temperature

        def score(parts: list[torch.Tensor]) -> torch.Tensor:  # [B, R], or [2, B, R] with entropy
            logprobs = part_logprobs(parts, targets, t)
            if not entropy:
                return logprobs
            ent = torch.cat([entropy_from_logits(p / t) for p in parts], 1)
            return torch.stack([logprobs, ent])

        out = engine(mb=mb, score=score)
        return (out[0], out[1]) if entropy else (out, None)

    def _check_accum(self, micro_batches: list[dict]) -> None:
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"got {len(micro_batches)} micro-batches, the engine was built for "
                             f"{self.grad_accum} per optimizer step; split batches the same way")

    @torch.no_grad()
    def prepare(self, micro_batches: list[dict]) -> list[dict]:
        """Before the update: old logprobs of the policy (and the reference's), per micro-batch.

        Computed once per rollout batch, so every epoch and mini-batch uses the same old policy.
        """
        self.engine.eval()
        out = []
        with scoring(self.engine) as policy:  # the reference only ever runs this forward
            for mb in micro_batches:
                item = {"old_logprobs": self._forward(policy, mb)[0].cpu()}
                ref = self._ref_logprobs(mb, policy)
                if ref is not None:
                    item["ref_logprobs"] = ref.cpu()
                out.append(item)
        return out

    @torch.no_grad()
    def _ref_logprobs(self, mb: dict, policy=None) -> torch.Tensor | None:
        """The reference's token logprobs of a micro-batch (None without a reference): the
        reference engine's, or with LoRA the policy's with its adapters off, run by `policy`
        (what `scoring` gives; opened here when None)."""
        if self.ref is not None:  # ZeRO-3: one gather of the whole frozen model, no hooks
            with scoring(self.ref) as ref:
                return self._forward(ref, mb)[0]
        if not self.base_reference:
            return None
        with ExitStack() as stack:
            if policy is None:
                policy = stack.enter_context(scoring(self.engine))
            stack.enter_context(self.peft.disable_adapter())
            module = self.engine.module  # the reference runs as the reference engine does:
            stack.callback(module.train, module.training)  # without dropout
            module.eval()
            return self._forward(policy, mb)[0]

    def train_step(self, micro_batches: list[dict], counts: BatchCounts) -> dict:
        """One optimizer step of the policy loss; metrics are this rank's share of global means.

        A micro-batch without `old_logprobs` takes them from this forward, detached (one pass:
        right when this is the only optimizer step on the batch, so the policy has not moved
        since the rollout); the reference then scores it here too, and the mismatch and KL
        metrics come from this forward.
        """
        self._check_accum(micro_batches)
        self._merged = None
        self.engine.train()
        counts = BatchCounts(counts.num_tokens, counts.num_seqs, self.norm_length)
        sums: dict[str, float] = {}
        for mb in micro_batches:
            dev = self.engine.device
            one_pass = "old_logprobs" not in mb
            ref = _to(mb, "ref_logprobs", dev)
            if ref is None:
                ref = self._ref_logprobs(mb)
            grad_entropy = self.loss_cfg.entropy_coef > 0
            with torch.set_grad_enabled(True):
                logprobs, ent = self._forward(self.engine, mb, entropy=grad_entropy)
            if not grad_entropy:  # the metric only: no graph through the entropy
                ent = None
            old = logprobs.detach() if one_pass else mb["old_logprobs"].to(dev)
            mask, rollout = mb["response_mask"].to(dev), _to(mb, "rollout_logprobs", dev)
            inputs = LossInputs(
                logprobs=logprobs, old_logprobs=old, advantages=mb["advantages"].to(dev),
                response_mask=mask, counts=counts, ref_logprobs=ref, rollout_logprobs=rollout,
                entropy=ent)
            loss, metrics = policy_loss(inputs, self.loss_cfg)
            self.engine.backward(loss * self.world_size * self.grad_accum)
            self.engine.step()
            add_metrics(sums, {k: float(v) for k, v in metrics.items()})
            if one_pass and rollout is not None:
                add_metrics(sums, old_logprob_metrics(old, rollout, ref, mask, counts,
                                                      self.loss_cfg.kl_estimator))
        sums["grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0)
        return sums

    def sft_step(self, micro_batches: list[dict], num_tokens: float) -> dict:
        """One optimizer step of supervised NLL on the response tokens (the warm-up)."""
        self._check_accum(micro_batches)
        self._merged = None
        self.engine.train()
        total = 0.0
        for mb in micro_batches:
            logprobs, _ = self._forward(self.engine, mb)
            loss = nll_loss(logprobs, mb["response_mask"].to(logprobs.device), num_tokens)
            self.engine.backward(loss * self.world_size * self.grad_accum)
            self.engine.step()
            total += loss.item()
        return {"loss/sft": total}

    @torch.no_grad()
    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token after the first (a collective under ZeRO-3: every rank calls)."""
        self.engine.eval()
        ids = torch.tensor([token_ids]).to(self.engine.device)
        with scoring(self.engine) as policy:
            logits = policy(input_ids=ids, attention_mask=torch.ones_like(ids),
                            use_cache=False).logits
        # raw (temperature 1), like vLLM's prompt logprobs
        return token_logprobs(logits[:, :-1], ids[:, 1:], 1.0)[0].tolist()

    def save_checkpoint(self, directory: str, tag: str) -> None:
        """DeepSpeed checkpoint (model, optimizer, LR state) in directory/tag; every rank calls.
        No `latest` file: the caller publishes a checkpoint once every part of it is written."""
        save_engine(self.engine, directory, tag, trained_only=self.peft is not None)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        self._merged = None
        load_engine(self.engine, directory, tag, trained_only=self.peft is not None)

    def full_state_dict(self) -> dict | None:
        """Unsharded weights on rank 0 (None elsewhere); a collective under ZeRO-3."""
        return full_state_dict(self.engine, self.cfg)

    def _whole(self, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter of the HF model (or its adapters only), whole, on every rank (one
        all-gather per dtype under ZeRO-3)."""
        from update.lora import is_adapter

        params = {n: p for n, p in self.module.named_parameters()
                  if not adapters_only or is_adapter(n)}
        if self.cfg.zero_stage == 3:
            return gathered_weights(params)
        return {n: p.detach() for n, p in params.items()}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """LoRA: the adapter tensors, whole, on every rank (a collective under ZeRO-3)."""
        return self._whole(adapters_only=True)

    def sync_module(self) -> torch.nn.Module:
        """The HF model a full-weight sync sends: the policy itself; with LoRA a plain model of
        the merged weights (W + scale * B @ A), built on every rank once per policy version, so
        that a sync and its byte check read the same tensors (a collective under ZeRO-3)."""
        if self.peft is None:
            return self.module
        if self._merged is None:
            from update.lora import merged, plain_model, scale

            self._merged = plain_model(self.module.config,
                                       merged(self._whole(), scale(self.cfg.lora)),
                                       dict(self.module.named_buffers()))
        return self._merged

    def release_merged(self) -> None:
        """Drop the merged model a sync built (LoRA, sync.lora=merged): a full copy per rank."""
        self._merged = None

    def save_hf(self, directory: str) -> None:
        """An HF model directory loadable by from_pretrained (weights only; rank 0 writes).
        With LoRA: `directory` is the adapter (loadable with peft, on the base model) and
        `directory`_merged the merged model."""
        import torch.distributed as dist

        if self.peft is not None:
            from update.lora import adapter_config, write_adapter

            adapter = self.adapter_weights()
            model = self.sync_module()
            if dist.get_rank() == 0:
                write_adapter(directory, adapter, adapter_config(self.cfg.lora, self.model_path))
                model.save_pretrained(f"{directory}_merged")
            return
        state = self.full_state_dict()
        if state is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.module.save_pretrained(directory, state_dict=state)


def full_state_dict(engine, cfg: TrainerConfig) -> dict | None:
    """Unsharded weights of a DeepSpeed engine on rank 0 (None elsewhere), named as the HF
    model names them (without the EngineModule's `body.model.`); a collective."""
    import torch.distributed as dist

    if cfg.zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if dist.get_rank() == 0 else None
    return None if state is None else {k.removeprefix("body.model."): v for k, v in state.items()}
