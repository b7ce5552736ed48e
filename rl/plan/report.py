"""The plan as a person reads it (tables), and the model's shape from `model.path` (a directory's
config.json, or a built-in's known shape): no weights loaded."""
from __future__ import annotations

from rl.plan.plan import GIB, Plan, fix_text
from rl.plan.shape import ModelShape

# the built-in real models' shapes (the GGUF's config, as transformers reads it)
GGUF_SHAPES = {"smollm2-135m": dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)}


def model_shape(path: str) -> ModelShape:
    """The shape of model.path: builtin presets and GGUF models by name, else config.json."""
    from rl.data.models import PRESETS

    name = path.removeprefix("builtin:")
    if path.startswith("builtin:") and name in PRESETS:
        p = PRESETS[name]
        return ModelShape(hidden=p.hidden_size, layers=p.num_layers, heads=p.num_heads,
                          kv_heads=p.num_kv_heads, head_dim=p.hidden_size // p.num_heads,
                          intermediate=p.intermediate_size, vocab=p.vocab_rows,
                          tied=p.tie_word_embeddings, qkv_bias=p.arch == "qwen2",
                          model_type=p.arch)
    if path.startswith("builtin:") and name in GGUF_SHAPES:
        return ModelShape.from_config(GGUF_SHAPES[name])
    return ModelShape.from_dir(path)


def gib(x: float) -> str:
    return f"{x / GIB:8.2f} GiB"


def seconds(x: float) -> str:
    return f"{x:8.3f} s" if x < 100 else f"{x:8.0f} s"


def render(plan: Plan, fix: dict | None) -> str:
    cfg, s, hw = plan.config, plan.shape, plan.cluster.hardware
    lines = [f"model: {s.model_type}, {s.params() / 1e9:.3g}B parameters ({s.layers} layers, "
             f"hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV, vocab {s.vocab})",
             f"hardware: {hw.name} x {plan.cluster.devices_per_node} per node x "
             f"{plan.cluster.nodes} node(s); {cfg.placement}, {cfg.ray.num_workers} trainer "
             f"rank(s), ZeRO-{cfg.trainer.zero_stage}, {cfg.trainer.dtype}; engines at TP "
             f"{cfg.rollout.tensor_parallel_size}, {cfg.rollout.dtype}",
             f"sequences: {plan.prompt_tokens} prompt + {cfg.rollout.max_new_tokens} response "
             f"tokens", *plan.notes, "", "memory per trainer rank:"]
    lines += [f"  {k:<22}{gib(v)}" for k, v in plan.trainer.items()]
    e = plan.engine
    lines += ["memory per engine TP rank:",
              f"  {'weights':<22}{gib(e['weights'])}",
              f"  {'kv cache':<22}{gib(e['kv_cache'])}  ({e['kv_per_token'] / 1024:.1f} KiB a "
              f"token, {e['kv_per_sequence'] / 2**20:.1f} MiB a sequence of "
              f"{cfg.rollout.max_model_len})",
              f"  {'kv blocks':<22}{e['kv_blocks']:8d}     of {cfg.rollout.block_size} tokens",
              f"  {'sequences at once':<22}{e['max_sequences']:8d}", "devices:"]
    lines += [f"  {k:<34} needs {gib(n)} of {gib(c)}" for k, (n, c) in plan.devices.items()]
    t = plan.time
    lines += ["time per step (utilizations: train {train:.2f}, decode {decode:.2f}, prefill "
              "{prefill:.2f}, sync {sync:.2f}):".format(**t["utilization"]),
              f"  {'rollout':<22}{seconds(t['rollout']['seconds'])}  ({t['rollout']['waves']} "
              f"wave(s) of {t['rollout']['batch']}, decode {t['rollout']['bound']}-bound)",
              f"  {'update':<22}{seconds(t['update']['seconds'])}",
              f"  {'sync':<22}{seconds(t['sync']['seconds'])}  "
              f"({t['sync']['bytes_per_tp_rank'] / GIB:.2f} GiB per TP rank)"]
    lines += [f"  {'step, ' + m:<22}{seconds(v)}" for m, v in t["step"].items()]
    if "speculation" in t:
        sp = t["speculation"]
        lines.append(f"  speculation: {sp['tokens_per_step']:.2f} tokens a verification step, "
                     f"decode x{sp['speedup']:.2f}")
    lines.append("")
    lines.append("verdict: fits" if plan.fits else f"verdict: does not fit: {plan.short}"
                 + (f"; smallest fix: {fix_text(fix)}" if fix else "; no single change found"))
    return "\n".join(lines)
