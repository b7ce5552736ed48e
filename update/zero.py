"""DeepSpeed engines as the trainers use them: the config, ZeRO-3 gathering (the whole model
in one collective, or module by module with each module released once used), forwards outside
ZeRO-3's hooks (`scoring`), and checkpoints."""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from functools import partial

import torch

from update.config import TrainerConfig
from update.forward import response_parts
from update.shards import shard_range


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
            # ZeRO-3's own linear (on by default) replaces torch.nn.functional.linear process-wide,
            # the colocated engine's linears included, and computes x @ W.t() with matmul: on a
            # strided input (the head's, while logits_to_keep was a count; kept_positions now
            # gathers it) that falls back to a batched matmul copying the weight once per sample
            # (a large vocabulary's head then dominated the step on CPU). zero3_linears instead
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
    one step to the next and it fetched every parameter on demand (the figures of this and
    what follows: docs/benchmarks.md#zero-3-against-zero-2).

    `whole` (ZeRO-3; `is_whole`): the model is one ZeRO-3 leaf module
    (`deepspeed.utils.set_z3_leaf_module`), gathered whole in one collective for the forward and
    again for the backward, its gradients reduced once the backward has left it, instead of a
    gather and DeepSpeed's hooks around every module (~60 per forward of a 2-layer model).
    DeepSpeed reduces a leaf's gradients when the gradients of its inputs are computed; token
    ids have none, so the `Body`'s anchor is that input."""

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
    (with it a forward ended holding every weight). Instead of
    DeepSpeed's `memory_efficient_linear`, which replaces torch.nn.functional.linear in the
    whole process: the colocated engine's linears and the head too (whose matmul, on the strided
    input a count of logits_to_keep made, fell back to a batched copy of the weight per sample).
    The head keeps torch's linear: its backward comes right after its forward."""
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
    the step it is checked against), and each training step then fetched on demand.

    Outside the hooks, a model gathered whole for training (`EngineModule.whole`) runs on a
    full copy of its weights gathered in one collective, once per context (`gathered_weights`,
    `torch.func.functional_call`, where a gather per layer costs more for a small model);
    another gathers each decoder layer just before it runs and releases it after
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
    `GatheredParameters` runs one per parameter), each rank's part put back by `shard_range`."""
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
            if world == 1:  # its one shard holds the whole parameter: a view, no copy
                full = shards[0, offset:offset + shard_range(0, size, p.ds_numel)[1]]
            else:
                full = torch.empty(p.ds_numel, dtype=dtype, device=local.device)
                for r in range(world):
                    start, count = shard_range(r, size, p.ds_numel)
                    full[start:start + count].copy_(shards[r, offset:offset + count])
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


def full_state_dict(engine, cfg: TrainerConfig) -> dict | None:
    """Unsharded weights of a DeepSpeed engine on rank 0 (None elsewhere), named as the HF
    model names them (without the EngineModule's `body.model.`); a collective."""
    import torch.distributed as dist

    if cfg.zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if dist.get_rank() == 0 else None
    return None if state is None else {k.removeprefix("body.model."): v for k, v in state.items()}
