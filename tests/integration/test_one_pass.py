"""The one-pass update (old logprobs from the training forward) equals the two-pass update (a
separate old-logprob forward first): same loss, KL, grad norm and updated weights, bit for bit
(both run the same kernels on the same shapes in the same order), on a real DeepSpeed ZeRO-3
engine (world size 1, gloo), with TIS and a KL loss to the reference."""
import pytest

from tests.spawn import spawn_world

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"



def _compare(rank: int, world_size: int, port: int, cache_dir: str, out) -> None:
    import os

    os.environ["RL_CACHE_DIR"] = cache_dir
    import torch
    import torch.nn.functional as F

    from rl.algo.batch import Sample, collate
    from rl.data.models import build_tiny_model
    from update.config import LossConfig, TrainerConfig
    from update.losses import BatchCounts, old_logprob_metrics
    from update.distributed import init_distributed
    from update.trainer import PolicyTrainer
    from update.zero import full_state_dict

    linear = F.linear
    torch.manual_seed(0)
    init_distributed(0, 1, "127.0.0.1", port)
    path = str(build_tiny_model("tiny-qwen2"))
    cfg = TrainerConfig(lr=1e-2, micro_batch_size=4)
    loss_cfg = LossConfig(kl_coef=0.05, kl_estimator="k3", tis_cap=2.0)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(8):
        prompt = torch.randint(5, 300, (4 + i % 3,), generator=gen).tolist()
        response = torch.randint(5, 300, (3 + i % 4,), generator=gen).tolist()
        samples.append(Sample(i, i // 4, prompt, response,
                              (-2.0 - torch.rand(len(response), generator=gen)).tolist(),
                              "stop", ""))
        samples[-1].advantages = [float(i % 3) - 1.0] * len(response)
    micros = [collate(samples[:4], 0), collate(samples[4:], 0)]
    counts = BatchCounts(float(sum(len(s.response_ids) for s in samples)), 8.0)
    results = {}
    for mode in ("two_pass", "one_pass"):
        trainer = PolicyTrainer(path, cfg, loss_cfg, grad_accum=2)
        batch = [dict(m) for m in micros]
        if mode == "two_pass":
            prepared = trainer.prepare(batch)
            for m, extra in zip(batch, prepared):
                m.update(extra)
            mask = torch.cat([m["response_mask"] for m in batch])
            pieces = [old_logprob_metrics(m["old_logprobs"], m["rollout_logprobs"],
                                          m["ref_logprobs"], m["response_mask"], counts, "k3")
                      for m in batch]
            assert mask.sum() == counts.num_tokens
        metrics = trainer.train_step(batch, counts)
        if mode == "two_pass":  # what the controller reports before a two-pass update
            for key in ("mismatch/kl", "kl/mean"):
                metrics[key] = sum(p[key] for p in pieces)
            metrics["mismatch/max_abs_diff"] = max(p["mismatch/max_abs_diff"] for p in pieces)
        state = full_state_dict(trainer.engine, cfg)
        results[mode] = (metrics, {k: v.clone() for k, v in state.items()})
    # ZeRO-3's "memory efficient" linear would have replaced F.linear process-wide (slow on the
    # strided hidden states that logits_to_keep slices); the config keeps torch's
    out["linear_replaced"] = F.linear is not linear
    (m2, w2), (m1, w1) = results["two_pass"], results["one_pass"]
    out["metrics"] = {k: (m2[k], m1.get(k)) for k in m2}
    out["weight_diff"] = max(float((w2[k] - w1[k]).abs().max()) for k in w2)
    out["moved"] = max(float((w2[k] - state_before).abs().max())
                       for k, state_before in _initial(path).items() if k in w2)


def _initial(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


@pytest.mark.integration
def test_one_pass_equals_two_pass(tmp_path):
    out = spawn_world(_compare, 1, str(tmp_path))
    for key in ("loss/policy", "loss/kl", "grad_norm", "mismatch/kl", "kl/mean",
                "mismatch/max_abs_diff", "mismatch/tis_weight_mean", "loss/ratio_mean"):
        two, one = out["metrics"][key]
        assert one == two, (key, two, one)
    assert out["moved"] > 1e-3, "the step must change the weights for the comparison to mean much"
    assert out["weight_diff"] == 0.0, out["weight_diff"]
    assert not out["linear_replaced"], "ZeRO-3 replaced torch.nn.functional.linear"

