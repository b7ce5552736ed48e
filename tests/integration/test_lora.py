"""LoRA on the real DeepSpeed trainer (2 ranks over gloo, the quickstart's shared-prompt layout,
a KL reference): after a step only the adapters moved and the base is bit-identical, at ZeRO
stages 0-3 alike (within rounding, tests/numerics.py); the reference is the base model (its
logprobs equal those of the model loaded alone); the merged model scores as the adapted
policy; and the checkpoint holds the adapters and their optimizer state only, from which the
next step is bit-identical."""
import json
from pathlib import Path

import pytest

from tests.integration.test_shared_prompts import rank_samples
from tests.spawn import spawn_world

pytestmark = pytest.mark.slow

PROBE = list(range(3, 40))
# ZeRO-3 gathered whole (the tiny model, as by default) and module by module (a larger model's
# default on several ranks: each module released once used, update.zero.zero3_linears
# wrapping PEFT's base and adapter linears)
STAGES = (0, 1, 2, 3, "3-modules")
ZERO = {"3-modules": dict(zero_stage=3, zero3_whole_model_max=0)}
def _logprobs(model, ids):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _run(rank: int, world_size: int, port: int, path: str, ckpt: str, out) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rl.algo.batch import collate
    from update.config import LoraConfig, LossConfig, TrainerConfig
    from update.distributed import init_distributed
    from update.trainer import PolicyTrainer

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port)
    samples, counts = rank_samples(rank, world_size, shortest=2)
    loss_cfg = LossConfig(kl_coef=0.05, kl_estimator="k3")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    results = {}
    for stage in STAGES:
        cfg = TrainerConfig(lr=1e-2, micro_batch_size=12, **ZERO.get(stage, dict(zero_stage=stage)),
                            lora=LoraConfig(rank=4, alpha=8.0), gradient_checkpointing=True)
        trainer = PolicyTrainer(path, cfg, loss_cfg, grad_accum=1)
        before = {k: v.clone() for k, v in trainer._whole().items()}
        batch = collate(samples, 0, share_prompts=True)
        prepared = trainer.prepare([batch])[0]
        batch.update(prepared)
        metrics = [trainer.train_step([batch], counts)]
        after = {k: v.clone() for k, v in trainer._whole().items()}
        later = trainer.prepare([collate(samples, 0, share_prompts=True)])[0]
        merged = _logprobs(trainer.sync_module(), PROBE)
        trainer_probe = torch.tensor(trainer.sequence_logprobs(PROBE))
        trainer.save_checkpoint(ckpt + f"/z{stage}", "policy")
        metrics.append(trainer.train_step([collate(samples, 0, share_prompts=True)], counts))
        results[stage] = dict(
            before=before, after=after, metrics=metrics, ref=prepared["ref_logprobs"],
            old=prepared["old_logprobs"], later=later, merged_probe=merged,
            mask=batch["response_mask"].bool(),
            checkpointing=trainer.module.is_gradient_checkpointing, shared=trainer.share_prompts,
            trainer_probe=trainer_probe,
            trained=[n for n, p in trainer.module.named_parameters() if p.requires_grad])
        del trainer
        resumed = PolicyTrainer(path, cfg, loss_cfg, grad_accum=1)
        resumed.load_checkpoint(ckpt + f"/z{stage}", "policy")
        results[stage]["resumed"] = resumed.train_step(
            [collate(samples, 0, share_prompts=True)], counts)
        del resumed
    # the reference without LoRA: a second model loaded from the path
    full = PolicyTrainer(path, TrainerConfig(micro_batch_size=12, zero_stage=2), loss_cfg, 1)
    results["ref_loaded"] = full.prepare([collate(samples, 0, share_prompts=True)])[0][
        "ref_logprobs"]
    results["base_probe"] = _logprobs(base, PROBE)
    out[rank] = results


def test_lora_trains_adapters_only_with_the_base_as_reference(tmp_path):
    import torch
    from transformers import AutoConfig

    from rl.data.models import build_tiny_model
    from tests.numerics import adam_update, depth, rounding, width

    path = str(build_tiny_model("tiny-qwen2", out_dir=tmp_path / "m"))
    out = spawn_world(_run, 2, path, str(tmp_path / "ckpt"))
    config = AutoConfig.from_pretrained(path)

    def tol(a, b, layers=depth(config)):  # two computations of logprobs a and b
        return rounding(float(max(a.abs().max(), b.abs().max())), layers, width(config))
    for rank in (0, 1):
        r = out[rank]
        for stage in STAGES:
            s = r[stage]
            assert s["trained"] and all(".lora_" in n for n in s["trained"]), s["trained"][:4]
            assert s["checkpointing"] and s["shared"]  # recompute, with prompts shared
            moved = [n for n in s["before"] if not torch.equal(s["before"][n], s["after"][n])]
            assert moved and all(".lora_" in n for n in moved), moved[:4]
            assert len([n for n in moved if ".lora_B" in n]) == len(
                [n for n in s["before"] if ".lora_B" in n])  # every B left zero
            # the reference is the base: equal to a separately loaded base model's, on the
            # response tokens (LoRA recomputes activations by default: the full layout, whose
            # padding positions hold other numbers than the shared-prompt layout's)
            def gap(a, mask=s["mask"]):
                return (a - r["ref_loaded"])[mask].abs().max()

            ref = r["ref_loaded"][s["mask"]]
            assert gap(s["ref"]) <= tol(s["ref"], ref)
            assert gap(s["old"]) <= tol(s["old"], ref)  # B = 0: policy = base
            # a step later: the reference is still the base, the policy moved
            assert gap(s["later"]["ref_logprobs"]) <= tol(s["later"]["ref_logprobs"], ref)
            assert gap(s["later"]["old_logprobs"]) > 1e-3
            # the merge adds one rounding of W + s·BA to each layer's weights
            assert (s["merged_probe"] - s["trainer_probe"]).abs().max() <= tol(
                s["merged_probe"], s["trainer_probe"], depth(config) + config.num_hidden_layers)
            assert (s["trainer_probe"] - r["base_probe"]).abs().max() > 1e-3  # it learned
            # resumed from the checkpoint (adapters and their optimizer state): bit-identical
            assert s["resumed"] == s["metrics"][1], (s["resumed"], s["metrics"][1])
    # the checkpoints hold the adapters and their optimizer state, not the base

    for stage in STAGES:
        files = list((tmp_path / "ckpt" / f"z{stage}").rglob("*"))
        size = sum(f.stat().st_size for f in files if f.is_file())
        base_bytes = sum(v.numel() * 4 for k, v in out[0][stage]["before"].items()
                         if ".lora_" not in k)
        assert size < base_bytes, (stage, size, base_bytes)
    for rank in (0, 1):
        r = out[rank]
        for stage in STAGES:  # every stage as ZeRO-2: the same start, the same update
            z2, z = r[2], r[stage]
            assert z2["before"].keys() == z["before"].keys()
            assert all(torch.equal(z2["before"][n], z["before"][n]) for n in z2["before"]), stage
            u2, u = (torch.cat([(x["after"][n] - x["before"][n]).flatten() for n in z2["before"]])
                     for x in (z2, z))
            relative = float((u - u2).norm() / u2.norm())
            assert relative <= adam_update(depth(config), width(config)), (stage, relative)
            loss2, loss = z2["metrics"][0]["loss/policy"], z["metrics"][0]["loss/policy"]
            # a mean of ratio * advantage terms, each from logprobs of the probe's magnitude
            assert abs(loss2 - loss) <= rounding(float(z2["trainer_probe"].abs().max()),
                                                 depth(config), width(config)), stage


@pytest.mark.parametrize("mode", ["adapters", "merged"])
def test_lora_syncs_pass_the_probe_and_a_skipped_one_is_caught(ray_session, placements,
                                                               tmp_path_factory, mode):
    """2 colocated workers (ZeRO-3 + vLLM): each sync makes the engines the adapted policy (the
    probe agrees; `adapters` moves the adapter's bytes only, into a new vLLM adapter per
    version, the old one removed), and after a real step without a sync the engines' stale
    adapter is caught by the probe."""
    from rl.plan.shape import ModelShape
    from tests.integration.test_weight_sync import colocated, update_once
    from weight_sync.verify import SyncVerificationError, check_logprobs

    ray = ray_session
    probe = list(range(3, 60))
    with colocated(placements, tmp_path_factory, "tiny-qwen2", 5, "trainer.lora.rank=4",
                   f"sync.lora={mode}", "algorithm.loss.kl_coef=0.01") as (
            workers, cfg, placement, path):
        tolerance = placement.measure_probe_noise(probe)["sync/tolerance"]
        # what a full sync moves (not the engine's parameters: an engine serving an adapter
        # keeps its base packed away, rollout.cpu_linear)
        full_bytes = ModelShape.from_dir(path).params() * 4
        for version in (1, 2):
            update_once(ray, workers)
            for trainer, engine in placement.probe_pairs(probe):  # not synced: stale
                with pytest.raises(SyncVerificationError):
                    check_logprobs(trainer, engine, tolerance, "engine")
            stats = placement.sync(version, probe)
            assert stats["sync/logprob_max_abs_diff"] <= tolerance
            loaded = ray.get([w.__ray_call__.remote(
                lambda self: sorted(self.rollout_role.engine.llm.llm_engine.list_loras())
                if self.rollout_role.engine.lora_rank else []) for w in workers])
            if mode == "adapters":
                assert stats["sync/bytes"] < 0.05 * full_bytes, (stats["sync/bytes"], full_bytes)
                assert loaded == [[version + 1]] * 2  # the new adapter only
            else:
                assert stats["sync/bytes"] >= full_bytes * 0.9 and loaded == [[]] * 2


# the quickstart_lora recipe (adapters on every linear layer of a ZeRO-3 policy, the reference
# the base with the adapter off, adapter syncs into vLLM's LoRA), 4 steps, a checkpoint every 2
# (the adapters and their optimizer state only), on the session's 2 x 0.5-CPU colocated actors
LORA_RUN = ["trainer.total_steps=4", "trainer.checkpoint_every=2", "warmup.sft_steps=4",
            "rollout.prompts_per_step=8", "data.eval_fraction=0", "trainer.eval_every=0",
            "run.loggers=[jsonl]", "ray.num_cpus_per_worker=0.5"]


def test_a_lora_run_resumed_from_its_adapters_is_bit_exact(placements, tmp_path, capsys):
    """A LoRA run resumed from its step_2 checkpoint (`--resume RUN/checkpoints/step_2`: the
    adapters, their optimizer state, the data position and RNG, the engines restored by a
    checked adapter sync) drops the lines logged past it and logs steps 3 and 4 bit for bit as
    the run did. The driver killed with SIGKILL and resumed is test_resume.py's (PPO); here
    the run goes on in this process, on the same actors."""
    from rl.config import load_config
    from rl.run.checkpoint import check_resume, find_resume_point
    from rl.run.controller import Controller
    from tests.integration.recipe_checks import check_step_metrics
    from tests.integration.test_resume import assert_same_steps

    cfg = load_config(str(Path(__file__).parents[2] / "recipes" / "quickstart_lora.yaml"),
                      LORA_RUN + [f"run.output_dir={tmp_path}"])
    run_dir = Controller(cfg, placements=placements).run()
    assert "reference policy: the base model" in capsys.readouterr().out

    def lines():
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    whole = lines()
    assert [m["step"] for m in whole] == [1, 2, 3, 4]
    check_step_metrics(cfg, whole)
    point = find_resume_point(cfg, str(run_dir / "checkpoints" / "step_2"))
    check_resume(cfg, point, allow_change=False)
    resumed = Controller(cfg, resume=point, placements=placements).run()
    assert resumed == run_dir
    assert_same_steps(whole, lines())  # steps 3 and 4 once each, bit for bit
    final = run_dir / "final_model"
    assert (final / "adapter_config.json").exists()
    assert (final.with_name("final_model_merged") / "config.json").exists()
