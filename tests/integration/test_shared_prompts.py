"""The shared-prompt update (each prompt run once, its responses on the cached keys and values)
equals the full layout's on real DeepSpeed ZeRO-3 engines, 2 ranks over gloo as in the
quickstart: same old and reference logprobs, loss, KL, grad norm and updated weights; under
gradient checkpointing too (the policy with an entropy bonus, and LoRA's reference: the base
with its adapters off), and for PPO's critic (its values and value loss)."""
import pytest

from tests.spawn import spawn_world

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"


def rank_samples(rank: int, world_size: int, shortest: int = 1) -> tuple[list, object]:
    """This rank's 3 prompts x 4 samples (responses of `shortest`-6 tokens) and the global
    BatchCounts."""
    import random

    from rl.algo.batch import Sample
    from update.losses import BatchCounts

    rng = random.Random(rank)
    samples = []
    for g in range(3):
        prompt = [rng.randrange(5, 300) for _ in range(6 + 3 * g)]
        for _ in range(4):
            response = [rng.randrange(5, 300) for _ in range(rng.randint(shortest, 6))]
            samples.append(Sample(g, g, prompt, response, [-rng.uniform(1, 3) for _ in response],
                                  "stop", "", advantages=[rng.uniform(-1, 1)] * len(response)))
    counts = BatchCounts(float(sum(len(s.response_ids) for s in samples) * world_size), 24.0)
    return samples, counts


def _embedded_rows(model, run) -> list[int]:
    """The batch rows of each forward of the model's embedding during run()."""
    rows = []
    embed = model.get_input_embeddings()
    handle = embed.register_forward_hook(lambda _m, inputs, _o: rows.append(inputs[0].shape[0]))
    try:
        run()
    finally:
        handle.remove()
    return rows


def _policy(path, samples, counts, cfg, loss_cfg, share: bool) -> dict:
    from rl.algo.batch import collate
    from update.trainer import PolicyTrainer
    from update.zero import full_state_dict

    trainer = PolicyTrainer(path, cfg, loss_cfg, grad_accum=1)
    batch = collate(samples, 0, share_prompts=share)
    prepared = trainer.prepare([batch])[0]
    before = full_state_dict(trainer.engine, cfg)
    before = {k: v.clone() for k, v in before.items()} if before else None
    metrics = {}
    rows = _embedded_rows(trainer.module,
                          lambda: metrics.update(trainer.train_step([batch], counts)))
    after = full_state_dict(trainer.engine, cfg)  # LoRA: the adapters' steps
    return {"shared_on": trainer.share_prompts, "prepared": prepared, "metrics": metrics,
            "rows": rows, "update": {k: after[k] - v for k, v in before.items()} if after else None}


def _critic(path, samples, counts, cfg, loss_cfg, share: bool) -> dict:
    import torch

    from rl.algo.batch import collate
    from update.critic import ValueTrainer

    critic = ValueTrainer(path, cfg, loss_cfg, grad_accum=1)
    torch.manual_seed(0)  # a head that reads the body (zeros read nothing)
    with torch.no_grad():
        for p in critic.engine.module.model.value_head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    batch = collate(samples, 0, share_prompts=share)
    values = critic.prepare([batch])[0]["values"]
    gen = torch.Generator().manual_seed(1)
    batch.update(values=values, returns=torch.randn(values.shape, generator=gen))
    metrics = {}  # (prepare runs outside ZeRO-3's hooks, and so outside this one)
    rows = _embedded_rows(critic.engine.module.model,
                          lambda: metrics.update(critic.train_step([batch], counts)))
    return {"shared_on": critic.share_prompts, "prepared": {"values": values},
            "metrics": metrics, "rows": rows}


def _compare(rank: int, world_size: int, port: int, path: str, out) -> None:
    import torch

    from rl.algo.batch import collate
    from update.config import LoraConfig, LossConfig, TrainerConfig
    from update.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port)
    samples, counts = rank_samples(rank, world_size)
    loss_cfg = LossConfig(kl_coef=0.05, kl_estimator="k3")
    with_entropy = LossConfig(kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
    cases = {"policy": (_policy, TrainerConfig(lr=1e-2, micro_batch_size=12, zero_stage=3),
                        loss_cfg),
             "recompute": (_policy, TrainerConfig(lr=1e-2, micro_batch_size=12, zero_stage=3,
                                                  gradient_checkpointing=True), with_entropy),
             "lora_recompute": (_policy, TrainerConfig(
                 lr=1e-2, micro_batch_size=12, zero_stage=3, gradient_checkpointing=True,
                 lora=LoraConfig(rank=4, alpha=8.0)), loss_cfg),
             "critic": (_critic, TrainerConfig(critic_lr=1e-2, micro_batch_size=12,
                                               zero_stage=3), loss_cfg)}
    mask = collate(samples, 0)["response_mask"]
    results = {}  # out is a process-shared dict: set whole, once
    for name, (run, cfg, loss) in cases.items():
        full, shared = (run(path, samples, counts, cfg, loss, share) for share in (False, True))
        prep0, prep1 = full["prepared"], shared["prepared"]
        results[name] = {
            "shared_on": shared["shared_on"], "rows": shared.get("rows"),
            "logprob_diff": max(float(((prep1[k] - prep0[k]).abs() * mask).max()) for k in prep0),
            "magnitude": max(float((prep0[k].abs() * mask).max()) for k in prep0),
            "metrics": {k: (full["metrics"][k], shared["metrics"][k]) for k in full["metrics"]},
            "update_diff": (_update_diff(full["update"], shared["update"])
                            if full.get("update") else None)}
    out[rank] = results


def _update_diff(d0: dict, d1: dict) -> tuple[float, float]:
    """(|update 0|, |update 1 - update 0| / |update 0|) over all weights, L2: Adam turns a
    rounding of a gradient near zero into a step of up to lr (tests/numerics.adam_update)."""
    import torch

    u0 = torch.cat([d.flatten() for d in d0.values()])
    u1 = torch.cat([d1[k].flatten() for k in d0])
    return float(u0.norm()), float((u1 - u0).norm() / u0.norm())


@pytest.mark.integration
def test_shared_prompt_update_equals_the_full_layout_on_two_zero3_ranks(tmp_path):
    from transformers import AutoConfig

    from rl.data.models import build_tiny_model
    from tests.numerics import adam_update, depth, rounding, width

    path = build_tiny_model("tiny-qwen2", out_dir=tmp_path / "model")  # once, before the ranks
    out = spawn_world(_compare, 2, str(path))
    config = AutoConfig.from_pretrained(path)
    for rank in (0, 1):
        for name, r in out[rank].items():
            assert r["shared_on"], f"{name}: the start-up check turned prompt sharing off"
            if r["rows"] is not None:  # 12 samples of 3 prompts: each prompt runs once
                assert r["rows"][:2] == [3, 12], (name, r["rows"])
            # old and reference logprobs (values): other attention shapes, equal within rounding
            tol = rounding(r["magnitude"], depth(config), width(config))
            assert r["logprob_diff"] <= tol, (name, r["logprob_diff"], tol)
            for key, (full, shared) in r["metrics"].items():
                if key.startswith("time/"):
                    continue
                bound = rounding(max(r["magnitude"], abs(full)), depth(config), width(config))
                assert abs(shared - full) <= bound, (rank, name, key, full, shared)
    for name in ("policy", "recompute", "lora_recompute"):
        moved, relative = out[0][name]["update_diff"]
        assert moved > 1e-3, f"{name}: the step must change the weights for the comparison"
        assert relative <= adam_update(depth(config), width(config)), (name, relative)
