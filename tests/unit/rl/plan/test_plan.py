"""The plan of a whole config: the verdict and the fix it computes (applied, it fits), the
time model's pieces, rl-plan on config.json-only directories, and rl-train's preflight refusal."""
import json
from pathlib import Path

import pytest

from rl.config import load_config
from rl.plan.hardware import PRESETS, Hardware
from rl.plan.plan import Cluster, make_plan, resolve_auto, smallest_fix, with_changes
from rl.plan.shape import ModelShape
from rl.plan.timing import speculation, step_seconds

ROOT = Path(__file__).parents[4]
LLAMA_7B, LLAMA_70B = ROOT / "docs/models/llama-7b", ROOT / "docs/models/llama-70b"
RL = ["trainer.dtype=bfloat16", "rollout.dtype=bfloat16", "rollout.max_model_len=4096",
      "rollout.max_new_tokens=1024", "rollout.prompts_per_step=64", "rollout.n=8",
      "trainer.micro_batch_size=4", "data.eval_fraction=0", "trainer.eval_every=0"]


def ram(gib: float) -> Hardware:
    return Hardware("cpu", memory_bytes=gib * 2 ** 30, bandwidth=1e10, bf16_flops=1e11,
                    fp32_flops=1e11, intra_link=1e10, inter_link=1e9, gpu=False)


def test_a_7b_that_does_not_fit_8_h100s_gets_a_fix_that_fits():
    cfg = load_config("recipes/quickstart.yaml", [f"model.path={LLAMA_7B}", "ray.num_workers=8",
                                                  *RL])
    shape, cluster = ModelShape.from_dir(LLAMA_7B), Cluster(PRESETS["h100-80g"], 1, 8)
    plan = make_plan(cfg, shape, cluster, 512)
    assert not plan.fits and "needs" in plan.short and "activations" in plan.short
    fix = smallest_fix(cfg, shape, cluster, 512)
    assert fix == {"trainer.gradient_checkpointing": True}
    assert make_plan(with_changes(cfg, fix), shape, cluster, 512).fits


def test_the_fix_for_a_15b_at_zero_0_on_this_kind_of_machine_fits():
    shape = ModelShape.from_config(dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
        tie_word_embeddings=True))
    cfg = load_config("recipes/quickstart.yaml", ["trainer.zero_stage=0"])
    cluster = Cluster(ram(20), 1, 1)
    assert not make_plan(cfg, shape, cluster, 40).fits
    fix = smallest_fix(cfg, shape, cluster, 40)
    assert fix and make_plan(with_changes(cfg, fix), shape, cluster, 40).fits
    assert not make_plan(cfg, shape, Cluster(ram(8), 1, 1), 40).fits


def test_auto_recomputes_exactly_where_the_activations_would_not_fit():
    """trainer.gradient_checkpointing=auto: off where the plan fits without recompute (the
    speed), on where only recompute makes it fit (the memory), for LoRA and full alike."""
    shape = ModelShape.from_dir(LLAMA_7B)
    for lora in ([], ["trainer.lora={rank: 8}"]):
        cfg = load_config("recipes/quickstart.yaml", [f"model.path={LLAMA_7B}", *RL, *lora])
        plain = with_changes(cfg, {"trainer.gradient_checkpointing": False})
        sizes = [g for g in range(16, 2048, 4)
                 if not make_plan(plain, shape, Cluster(ram(g), 1, 1), 512).fits
                 and make_plan(with_changes(cfg, {"trainer.gradient_checkpointing": True}),
                               shape, Cluster(ram(g), 1, 1), 512).fits]
        assert sizes, "a machine where only recompute fits"
        tight, roomy = Cluster(ram(sizes[0]), 1, 1), Cluster(ram(8192), 1, 1)
        note = resolve_auto(cfg, shape, tight, 512)
        assert cfg.trainer.gradient_checkpointing is True and "does not fit" in note, note
        cfg.trainer.gradient_checkpointing = "auto"
        note = resolve_auto(cfg, shape, roomy, 512)
        assert cfg.trainer.gradient_checkpointing is False and "activations" in note, note
        assert resolve_auto(cfg, shape, tight, 512) == ""  # a set value stays
        assert cfg.trainer.gradient_checkpointing is False


def test_more_memory_never_makes_a_plan_stop_fitting():
    cfg = load_config("recipes/quickstart.yaml", [f"model.path={LLAMA_7B}", *RL])
    shape = ModelShape.from_dir(LLAMA_7B)
    fits = [make_plan(cfg, shape, Cluster(ram(g), 1, 1), 512).fits for g in (16, 64, 256, 1024)]
    assert fits == sorted(fits) and fits[-1] and not fits[0]


def test_speculation_tokens_and_where_it_pays():
    assert speculation(0.0, 3, 1.0, 0.0, "memory")["tokens_per_step"] == pytest.approx(1.0)
    assert speculation(0.8, 3, 1.0, 0.0, "memory")["tokens_per_step"] == pytest.approx(
        1 + 0.8 + 0.64 + 0.512)
    assert speculation(0.8, 3, 1.0, 0.0, "memory")["speedup"] > 2  # reading weights: pays
    assert speculation(0.8, 3, 1.0, 0.0, "compute")["speedup"] < 1  # computing: never


def test_pipeline_modes_overlap_what_they_can():
    assert step_seconds(3.0, 2.0, 1.0, "sync") == 6.0
    assert step_seconds(3.0, 2.0, 1.0, "one_step") == 3.0
    assert step_seconds(1.0, 2.0, 0.5, "fully_async") == 2.0


@pytest.mark.parametrize("model", [LLAMA_7B, LLAMA_70B])
@pytest.mark.parametrize("nodes", [1, 4])
def test_rl_plan_on_a_config_json_only_directory(model, nodes, capsys):
    from rl.cli import plan_main

    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    assert plan_main(["recipes/quickstart.yaml", f"model.path={model}", *RL,
                      "rollout.tensor_parallel_size=8", "--hardware", "h100-80g",
                      "--gpus-per-node", "8", "--nodes", str(nodes), "--prompt-tokens", "512",
                      "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nodes"] == nodes and plan["devices_per_node"] == 8
    assert plan["time"]["step"]["sync"] > 0 and plan["engine"]["kv_blocks"] > 0
    assert plan["fits"] or plan["fix"]
    assert plan["notes"][0].startswith("trainer.gradient_checkpointing=auto -> ")


def test_rl_train_refuses_what_cannot_fit_before_ray_with_one_line(monkeypatch, capsys):
    import rl.preflight
    from rl.cli import main

    monkeypatch.setattr(rl.preflight, "local_hardware", lambda cfg: ram(12))
    code = main(["recipes/quickstart.yaml", f"model.path={LLAMA_7B}"])
    out, err = capsys.readouterr()
    assert "trainer.gradient_checkpointing=auto -> true: without recompute" in out
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("rl-train: the plan does not fit")
    assert "needs" in err[0] and "has 11.4 GiB" in err[0] and "smallest fix:" in err[0]
    assert "run.fit_check=false" in err[0]


def test_an_adapter_sync_moves_the_adapter_alone():
    """sync.lora=adapters: the adapter whole, in the trainer's dtype (a Qwen2.5-3B-shaped run's
    sync/bytes here: 29,933,568, rank 8 on every linear in bf16); merged: the model's weights."""
    shape = ModelShape.from_config(dict(
        model_type="qwen2", hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
        tie_word_embeddings=True))
    lora = ["trainer.lora={rank: 8, target_modules: [all-linear]}", "trainer.dtype=bfloat16",
            "rollout.dtype=bfloat16"]
    for sync, want in (("adapters", 29_933_568), ("merged", shape.params() * 2)):
        cfg = load_config("recipes/quickstart.yaml", [*lora, f"sync.lora={sync}"])
        plan = make_plan(cfg, shape, Cluster(ram(64), 1, 1), 31)
        assert plan.time["sync"]["bytes_per_tp_rank"] == want, sync


def test_the_cpu_measures_its_bf16_rate_and_falls_back_to_float32(monkeypatch):
    """bf16 on a CPU runs 4.5x float32 with AVX-512 bf16 and ~100x slower on AVX2: the planner
    times it (torch, in a subprocess) rather than taking it as float32, unless torch fails."""
    from rl.plan import hardware

    assert hardware.bf16_matmul_rate(0.1) > 0
    monkeypatch.setattr(hardware, "bf16_matmul_rate", lambda seconds: 123.0)
    assert hardware.measure_cpu(0.3).bf16_flops == 123.0
    monkeypatch.setattr(hardware, "bf16_matmul_rate", lambda seconds: None)
    hw = hardware.measure_cpu(0.3)
    assert hw.bf16_flops == hw.fp32_flops and "taken as fp32" in hw.sources["flops"]


def test_a_cpu_nodes_ranks_and_engines_share_its_cores_where_gpus_have_one_each():
    """The same work per trainer rank and per engine: two ranks on one CPU node compute at half
    the node's rate each (so do two engines), one rank per GPU at the whole GPU's."""
    def plan(workers, hw):
        cfg = load_config(None, ["model.path=builtin:tiny-qwen2", f"ray.num_workers={workers}",
                                 f"rollout.prompts_per_step={8 * workers}",
                                 "trainer.zero_stage=0", "data.eval_fraction=0"])
        return make_plan(cfg, ModelShape(hidden=256, intermediate=1024, layers=4, heads=4,
                                         kv_heads=4, head_dim=64, vocab=1000, tied=True),
                         Cluster(hw, 1, 1),
                         prompt_tokens=24).time

    cpu, gpu = ram(64), PRESETS["h100-80g"]
    for hw, factor in ((cpu, 2), (gpu, 1)):
        one, two = plan(1, hw), plan(2, hw)
        assert two["update"]["compute_seconds"] == pytest.approx(
            factor * one["update"]["compute_seconds"])
        assert two["rollout"]["prefill"] == pytest.approx(factor * one["rollout"]["prefill"])


def test_a_cached_cpu_measurement_takes_this_versions_calibration(tmp_path, monkeypatch):
    """The cache keeps what was measured; utilizations and fixed costs come from the code, so
    a recalibration reaches machines that measured before it."""
    from dataclasses import replace

    from rl.plan import hardware, run

    stale = replace(ram(8), train_utilization=0.01, layer_pass_overhead=9.0)
    monkeypatch.setattr(run, "measure_cpu", lambda: stale)
    run.cached_cpu(tmp_path)  # measured and cached (stale figures)
    monkeypatch.setattr(run, "measure_cpu", lambda: pytest.fail("measured again"))
    hw = run.cached_cpu(tmp_path)
    assert hw.bandwidth == stale.bandwidth  # measured once
    assert hw.train_utilization == hardware.CPU_UTILIZATION["train"]
    assert hw.layer_pass_overhead == hardware.CPU_OVERHEADS["layer_pass_overhead"]


def test_runs_started_together_measure_this_cpu_once(tmp_path, monkeypatch):
    """Three runs asking at once (vs_trl.py --jobs, the suite's early runs): one measures while
    the others wait for its figures (each measured, against the others' load, before)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from rl.plan import run

    measured = []

    def measure():
        measured.append(1)
        time.sleep(0.2)
        return ram(8)

    monkeypatch.setattr(run, "measure_cpu", measure)
    with ThreadPoolExecutor(3) as pool:
        found = list(pool.map(lambda _: run.cached_cpu(tmp_path), range(3)))
    assert len(measured) == 1 and len({hw.bandwidth for hw in found}) == 1


def test_the_plan_says_the_counts_its_times_are_made_of():
    """benchmarks/plan_check.py fits the fixed costs to the counts the plan reports (decode
    steps, a step's fixed cost, layer passes): they are the ones its times were built from."""
    from dataclasses import replace

    for stage in (0, 3):
        cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "ray.num_workers=2",
                                 f"trainer.zero_stage={stage}", "data.eval_fraction=0"])
        shape = ModelShape(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=4,
                           head_dim=64, vocab=1000, tied=True)
        hw = replace(ram(64), decode_step_overhead=0.5, decode_sequence_overhead=0.25,
                     layer_pass_overhead=0.125, zero3_pass_overhead=0.0625)
        t = make_plan(cfg, shape, Cluster(hw, 1, 1), prompt_tokens=24).time
        roll, upd = t["rollout"], t["update"]
        assert roll["decode"] == pytest.approx(roll["decode_steps"] * roll["decode_step"])
        assert roll["decode_step_fixed"] == pytest.approx(0.5 + roll["batch"] * 0.25)
        assert upd["overhead_seconds"] == pytest.approx(
            upd["layer_passes"] * 0.125 + upd["zero3_layer_passes"] * 0.0625)
        assert (upd["zero3_layer_passes"] > 0) == (stage == 3) and upd["layer_passes"] > 0
