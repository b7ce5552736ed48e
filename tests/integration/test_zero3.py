"""ZeRO-3 as the update runs it (update.zero.EngineModule, `scoring`) against ZeRO-2, on real
DeepSpeed engines, 2 ranks over gloo with the quickstart's shared-prompt layout and a KL
reference: the same losses, gradient norms, probe logprobs and updates, within rounding
(tests/numerics.py: the partitioned reductions round the gradients otherwise), for the
policy gathered module by module (each module's weights released once used, DeepSpeed's
ZeRO-3 linear in the decoder layers) and whole (the default: one leaf module, also under gradient
checkpointing); a PPO critic alike. And
the probe and the old-logprob pass, run between training steps as rl-train runs them, leave
ZeRO-3's record of the step's module order whole (else every step fetches on demand)."""
import pytest

from tests.integration.test_shared_prompts import rank_samples
from tests.spawn import spawn_world

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

WHOLE = dict(zero_stage=3, zero3_whole_model_max=10**9)
MODULES = dict(zero_stage=3, zero3_whole_model_max=0)
CONFIGS = {"zero2": dict(zero_stage=2), "zero3": MODULES,
           "zero3_whole": WHOLE,
           # activations recomputed in the backward, inside the leaf (full layout: HF turns the
           # cache off under checkpointing)
           "zero2_checkpointing": dict(zero_stage=2, gradient_checkpointing=True),
           "zero3_whole_checkpointing": dict(WHOLE, gradient_checkpointing=True),
           "zero3_checkpointing": dict(MODULES, gradient_checkpointing=True)}
PAIRS = [("zero2", "zero3"), ("zero2", "zero3_whole"),
         ("zero2_checkpointing", "zero3_whole_checkpointing"),
         ("zero2_checkpointing", "zero3_checkpointing")]
PROBE = list(range(3, 40))


def _run(rank: int, world_size: int, port: int, path: str, out) -> None:
    import torch

    from rl.algo.batch import collate
    from update.config import LossConfig, TrainerConfig
    from update.critic import ValueTrainer
    from update.distributed import init_distributed
    from update.trainer import PolicyTrainer
    from update.zero import full_state_dict, z3_whole

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port)
    samples, counts = rank_samples(rank, world_size, shortest=2)
    loss_cfg = LossConfig(kl_coef=0.05, kl_estimator="k3")
    results = {}
    for name, extra in CONFIGS.items():
        cfg = TrainerConfig(lr=1e-3, micro_batch_size=12, **extra)
        trainer = PolicyTrainer(path, cfg, loss_cfg, grad_accum=1)
        coordinator = (trainer.engine.optimizer.parameter_offload.get_param_coordinator()
                       if cfg.zero_stage == 3 else None)
        probes, metrics, traces = [trainer.sequence_logprobs(PROBE)], [], []  # a probe first
        for step in range(4):
            batch = collate(samples, 0, share_prompts=True)
            if step == 2:  # a two-pass step: old logprobs from their own forward
                batch.update(trainer.prepare([batch])[0])
            metrics.append(trainer.train_step([batch], counts))
            if coordinator is not None:
                traces.append(coordinator.is_complete_trace())
            probes.append(trainer.sequence_logprobs(PROBE))
        engine_probe = None
        if cfg.zero_stage == 3:  # the probe through ZeRO-3's own forward, for comparison
            ids = torch.tensor([PROBE])
            with torch.no_grad():
                logits = trainer.engine(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        use_cache=False).logits[0, :-1]
            engine_probe = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()
        state = full_state_dict(trainer.engine, cfg)
        buffers = zero3_buffers(trainer.engine.optimizer) if cfg.zero_stage == 3 else None
        critic = ValueTrainer(path, cfg, loss_cfg, grad_accum=1)
        full = collate(samples, 0)
        full.update(critic.prepare([full])[0])
        full["returns"] = full["values"] + torch.linspace(-1, 1, full["values"].shape[1])
        critic_metrics = critic.train_step([full], counts)
        values_after = critic.prepare([full])[0]["values"]
        results[name] = dict(
            whole=z3_whole(trainer.engine.module), ref_whole=z3_whole(trainer.ref.module),
            metrics=metrics, probes=probes,
            engine_probe=engine_probe, traces=traces, buffers=buffers,
            weights={k: v.clone() for k, v in state.items()} if state else None,
            critic=(critic_metrics, values_after))
        del trainer, critic
    out[rank] = results


def zero3_buffers(optimizer) -> dict:
    """The elements of what DeepSpeed's ZeRO-3 optimizer keeps beside the model states, as
    rl.plan.memory.zero_buffers counts them: the float32 master partition where it is a copy (not
    the weights' own storage), the reduce bucket, and the weights' partition."""
    own = {t.untyped_storage().data_ptr() for t in optimizer.fp16_partitioned_groups_flat}
    return dict(copy=sum(t.numel() for t in optimizer.fp32_partitioned_groups_flat
                         if t.untyped_storage().data_ptr() not in own),
                bucket=max(b.buffer.numel() for b in optimizer.ipg_buckets.values()),
                partition=sum(t.numel() for t in optimizer.fp16_partitioned_groups_flat))


def _within(a: dict, b: dict, tol) -> bool:
    """Every metric of a within tol(magnitude) of b's: each is computed from token logprobs and
    ratios of such, of at most the probe's magnitude (grad_norm: its own)."""
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol(max(abs(a[k]), 1.0)) for k in a)


@pytest.mark.integration
def test_zero3_equals_zero2_and_keeps_its_trace(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rl.data.models import build_tiny_model
    from tests.numerics import adam_update, depth, rounding, width

    # before the ranks join their group: transformers writes model files on rank 0 only
    path = build_tiny_model("tiny-qwen2", out_dir=tmp_path / "m")
    out = spawn_world(_run, 2, str(path))
    config, initial = AutoConfig.from_pretrained(path), load_file(f"{path}/model.safetensors")

    def tol(magnitude, steps=0):
        return rounding(magnitude, depth(config, steps), width(config))

    check_planned_buffers(out[0], config.to_dict())
    for rank, results in out.items():
        # the policy gathered whole where asked, the frozen reference as the policy
        assert [results[c]["whole"] for c in CONFIGS] == [False, False, True, False, True, False]
        assert [results[c]["ref_whole"] for c in CONFIGS] == [False, False, True, False, True,
                                                              False]
        big = max(1.0, max(abs(x) for p in results["zero2"]["probes"] for x in p))
        for base, name in PAIRS:
            z2, z3 = results[base], results[name]
            for step, (m2, m3) in enumerate(zip(z2["metrics"], z3["metrics"], strict=True)):
                assert _within(m2, m3, lambda m: tol(max(m, big), step)), (name, m2, m3)
            for step, (p2, p3) in enumerate(zip(z2["probes"], z3["probes"], strict=True)):
                assert max(abs(x - y) for x, y in zip(p2, p3)) <= tol(big, step), name
            # the probe outside ZeRO-3's hooks reads what ZeRO-3's own forward reads
            assert max(abs(x - y) for x, y in zip(z3["probes"][-1], z3["engine_probe"])) <= tol(
                big)
            # the probe before step 1, the probes after each step and the old-logprob pass of
            # step 3 all left the record of the training step whole from step 2 on
            assert z3["traces"][1:] == [True] * 3, (name, z3["traces"])
            (c2, v2), (c3, v3) = z2["critic"], z3["critic"]
            assert _within(c2, c3, lambda m: tol(max(m, big))), name
            assert float((v2 - v3).abs().max()) <= tol(float(v2.abs().max()), 1), name
            if rank == 0:  # the updates, as whole vectors (a max over weights bounds nothing)
                w2, w3 = z2["weights"], z3["weights"]
                assert w2.keys() == w3.keys()
                u2 = torch.cat([(w2[k] - initial[k]).flatten() for k in w2])
                u3 = torch.cat([(w3[k] - initial[k]).flatten() for k in w2])
                relative = float((u3 - u2).norm() / u2.norm())
                assert relative <= adam_update(depth(config), width(config)), (name, relative)


def check_planned_buffers(results: dict, config: dict) -> None:
    """What the planner counts beside ZeRO-3's model states is what DeepSpeed holds: a float32
    master copy of the partition (DeepSpeed's reuse of float32 weights never applies) and a
    reduce bucket of update.zero's size (a decoder layer or the embedding, module by module;
    DeepSpeed's default whole)."""
    from rl.plan.memory import TrainerSide, reduce_bucket
    from rl.plan.shape import ModelShape

    shape = ModelShape.from_config(config)
    for name, extra in CONFIGS.items():
        if extra["zero_stage"] != 3:
            continue
        side = TrainerSide(ranks=2, zero_stage=3, dtype="float32", bf16_mode="weights",
                           micro_batch=12, prompt_tokens=1, response_tokens=1, group_size=1,
                           share_prompts=True, checkpointing=False,
                           whole_model_max=extra["zero3_whole_model_max"], release=True,
                           reference=True, critic=False)
        got = results[name]["buffers"]
        assert got["copy"] == got["partition"] > 0, (name, got)
        assert got["bucket"] == reduce_bucket(shape, side), (name, got)
