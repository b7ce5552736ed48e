"""A tensor-parallel vLLM engine (TP 2: a worker process per rank, one core each) against TP 1 on
the same weights, and a sync that writes each rank's slice into its shared weights
(weight_sync.tp_shared); then a disaggregated run on a TP 2 engine, whose probe passes after
every sync and stops the run at a sync that missed a rank. The engines of the first part run in
a process of their own (python -m this module, started with the session beside the unit tests:
tests/early.py): vLLM's TP workers are processes of the engine's process, and this keeps
pytest's clean."""
import json
import os
import sys
from pathlib import Path

import pytest

from tests.early import early

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

MAX_NEW = 12


def hf_logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    """Each token's logprob after the first, under a transformers model (the probe's side)."""
    import torch

    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def perturbed(model, seed: int) -> dict:
    """The model's state with seeded noise on every weight (as if trained), by HF name."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engines_main(out_dir: str) -> None:
    """Both engines; greedy tokens and prompt logprobs before and after syncs, and under faults."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from rl.data.models import build_tiny_model
    from rollout.config import RolloutConfig
    from rollout.vllm_engine import VLLMEngine
    from weight_sync.buckets import tied_head_alias
    from weight_sync.in_place import EngineLayout
    from weight_sync.resharding import TPSpec
    from weight_sync.tp_shared import TPSharedWeights

    model_path = str(build_tiny_model("tiny-qwen2", seed=5, out_dir=Path(out_dir) / "model"))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"  # as a Role binds an actor with both cores
    cfg = RolloutConfig(n=1, max_new_tokens=MAX_NEW, max_model_len=128, kv_cache_gib=0.05)
    tp1 = VLLMEngine(model_path, cfg, seed=0, device="cpu")
    tp2 = VLLMEngine(model_path, dataclasses.replace(cfg, tensor_parallel_size=2), seed=0,
                     device="cpu")
    prompts = [[1 + (7 * i + j) % 50 for j in range(5 + i)] for i in range(6)]

    def observe(engine):
        groups = engine.generate(prompts, greedy=True)
        tokens = [g[0].token_ids for g in groups]
        return tokens, engine.prompt_logprobs_many([p + t for p, t in zip(prompts, tokens)])

    result = {"before": [observe(tp1), observe(tp2)], "cores": tp2.core_binding}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32")
    spec = TPSpec.from_hf_config(model.config, tp_size=2)
    shared = TPSharedWeights.create(tp2, spec)
    result["bytes_per_rank"] = [sum(m.nbytes for m in shared.layouts[r].tensors)
                                for r in range(2)]
    result["tp1_bytes"] = sum(m.nbytes for m in EngineLayout.of(tp1.parameters()).tensors)

    state = perturbed(model, seed=1)
    aliases = tied_head_alias(model)
    tp1.load_weights(state.items())
    written = shared.write(state.items(), aliases)
    result["written"] = [written[r] for r in range(2)]
    tp2.weights_changed()
    after = [observe(tp1), observe(tp2)]
    result["after"] = after
    result["hf_after"] = hf_logprobs(model, [p + t for p, t in zip(prompts, after[1][0])])

    # a fault: the next sync reaches rank 0 only
    state = perturbed(model, seed=2)
    tp1.load_weights(state.items())
    shared.write(state.items(), aliases, ranks=[0])
    tp2.weights_changed()
    result["one_rank"] = [observe(tp1), observe(tp2)]
    (Path(out_dir) / "out.json").write_text(json.dumps(result))


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


ENGINES = early("tensor_parallel", __file__, lambda tmp: [
    sys.executable, "-m", "tests.integration.test_tensor_parallel", str(tmp)])


@pytest.fixture(scope="module")
def observed():
    ENGINES.passed()
    return json.loads((ENGINES.dir / "out.json").read_text())


def rounding_of(*logprobs) -> float:
    """tests/numerics.rounding for two computations of these logprobs by the test's model (TP 1
    and TP 2 engines, vLLM and transformers: other kernels, other reduction splits)."""
    from tests.numerics import model_rounding

    values = [x for lps in logprobs for row in lps for x in row]
    return model_rounding(ENGINES.dir / "model", values)


@pytest.mark.integration
def test_tp2_engine_equals_tp1_and_each_rank_takes_its_slice(observed):
    (tokens1, lp1), (tokens2, lp2) = observed["before"]
    assert observed["cores"] == "0|1"  # a rank per core
    assert tokens2 == tokens1 and all(len(t) == MAX_NEW for t in tokens1)
    assert max_diff(lp1, lp2) <= rounding_of(lp1, lp2)
    # each rank holds its slice only: about half the weights (the norms are replicated)
    assert all(b <= 0.55 * observed["tp1_bytes"] for b in observed["bytes_per_rank"])
    # after a sync of new weights, written as slices into the ranks' shared memory
    (tokens1, lp1), (tokens2, lp2) = observed["after"]
    assert tokens2 == tokens1
    assert max_diff(lp1, lp2) <= rounding_of(lp1, lp2)
    hf = observed["hf_after"]
    assert max_diff(lp2, hf) <= rounding_of(lp2, hf)  # the weights are the trainer's
    assert max_diff(lp1, observed["before"][0][1]) > 1e-2  # and they did change
    assert observed["written"][0] == observed["written"][1]


@pytest.mark.integration
def test_a_rank_the_sync_missed_is_seen_by_its_logprobs(observed):
    (_, lp1), (_, lp2) = observed["one_rank"]
    assert max_diff(lp1, lp2) > 1e-2  # far beyond the probe's 1e-3 in float32


def _sync_misses_rank_1(self) -> None:
    """In the rollout actor: its syncs receive TP rank 1's buckets into scratch memory, not into
    the rank's weights (a fault)."""
    import torch

    digest, memory = self.rollout_role.packed
    self.rollout_role.packed = (digest, [memory[0], torch.empty_like(memory[1])])


def _misplaces_a_tensor(self) -> None:
    """In colocated worker 1: its syncs write its part of layer 1's o_proj where layer 0's goes
    and the other way round (a fault: every slice filled, two at the wrong place)."""
    sync = self.colocated_sync  # weight_sync.colocated.ColocatedSync
    write = sync.write_slices

    def swapped(params: list, aliases: dict) -> list:
        names = [n for n, _ in params]
        i, j = (names.index(f"model.layers.{k}.self_attn.o_proj.weight") for k in (0, 1))
        params = list(params)
        params[i], params[j] = (names[i], params[j][1]), (names[j], params[i][1])
        return write(params, aliases)

    sync.write_slices = swapped


def _engine_cores(self) -> list:
    """In colocated worker 0: the binding its TP engine was given, each rank's CPU affinity, and
    how long each rank spins once the engine's calls stop (rollout.tp_worker)."""
    engine = self.rollout_role.engine
    affinity = engine.llm.collective_rpc(
        lambda worker: sorted(__import__("os").sched_getaffinity(0)))
    spin = engine.llm.collective_rpc(lambda worker: __import__(
        "vllm.distributed.device_communicators.shm_broadcast", fromlist=["SpinCondition"]
    ).SpinCondition.__dict__.get("rl_idle_spin"))
    return [engine.core_binding, affinity, spin]


def _model_bytes(self) -> int:
    """In a trainer: the bytes of its whole model (all ranks' shards together)."""
    from weight_sync.buckets import full_numel

    module = self.trainer_role.trainer.module
    return sum(full_numel(p) * p.element_size() for p in module.parameters())


def _steps_then_fault(cfg, fault, target: str) -> dict:
    """2 steps of a run, then `fault` in the `target` actor and a third step, which must stop
    at its sync (SyncVerificationError)."""
    import ray

    from rl.run.controller import Controller
    from weight_sync.verify import SyncVerificationError

    c = Controller(cfg)
    c.setup()
    result = {}
    try:
        result["metrics"] = [c.step(k) for k in (1, 2)]
        result["model_bytes"] = ray.get(c.placement.trainers[0].__ray_call__.remote(
            _model_bytes))
        if cfg.placement == "colocated":
            result["cores"] = ray.get(c.placement.trainers[0].__ray_call__.remote(_engine_cores))
            result["engines"] = len(c.placement.engines)
        actor = eval(f"c.placement.{target}")  # noqa: S307 (a fixed expression of this module)
        ray.get(actor.__ray_call__.remote(fault))
        try:
            c.step(3)
            result["stopped"] = None
        except SyncVerificationError as e:
            result["stopped"] = str(e)
    finally:
        c.life.shutdown()
    return result


def run_main(out_dir: str) -> None:
    """Runs on TP 2 engines (one Ray for both): disaggregated in fully_async mode (one engine's
    actor, one trainer), then colocated (2 workers, one engine over both). The first stops at a sync that missed a
    rank, the second at one that put a tensor at another's place."""
    import ray

    from rl.config import load_config
    from rl.run.cluster import start_ray

    recipes = Path(__file__).parents[2] / "recipes"
    small = ["rollout.tensor_parallel_size=2", "rollout.prompts_per_step=8", "rollout.n=4",
             "trainer.micro_batch_size=8", "warmup.sft_steps=30", "warmup.batch_size=32",
             "data.eval_fraction=0", "trainer.eval_every=0"]
    # fully_async: generation goes on during the update, and each sync pauses the engine's
    # loop (cutting the sequences in flight) and resumes it under the new version; the TP ranks
    # share both cores with the trainer (a core per rank)
    disaggregated = load_config(str(recipes / "quickstart_fully_async.yaml"), [
        *small, "ray.num_workers=1", "ray.num_rollout_workers=1", "ray.num_cpus_per_worker=0.5",
        "ray.num_cpus_per_rollout_worker=0.5", "ray.split_cores=false",
        f"run.output_dir={out_dir}/disaggregated"])
    colocated = load_config(str(recipes / "quickstart.yaml"), [
        *small, "ray.num_workers=2", f"run.output_dir={out_dir}/colocated"])
    start_ray(disaggregated)
    try:
        result = {"disaggregated": _steps_then_fault(disaggregated, _sync_misses_rank_1,
                                                     "engines[0]"),
                  "colocated": _steps_then_fault(colocated, _misplaces_a_tensor, "trainers[1]")}
    finally:
        ray.shutdown()
    (Path(out_dir) / "run.json").write_text(json.dumps(result))


# with the integration tests, in the session's cache, once the engines' process has ended
RUN = early("tensor_parallel_run", __file__, lambda tmp: [
    sys.executable, "-m", "tests.integration.test_tensor_parallel", "run", str(tmp)],
    after=ENGINES, with_integration=True)


@pytest.fixture(scope="module")
def runs():
    RUN.passed()
    return json.loads((RUN.dir / "run.json").read_text())


@pytest.mark.integration
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_a_run_on_a_tp2_engine_checks_every_sync(runs, placement):
    run = runs[placement]
    assert [m["step"] for m in run["metrics"]] == [1, 2]
    if placement == "disaggregated":  # fully_async: step 2 trained samples of version 0
        assert run["metrics"][1]["rollout/staleness_max"] >= 1, run["metrics"][1]
    for m in run["metrics"]:
        assert m["sync/logprob_max_abs_diff"] <= m["sync/tolerance"] == 1e-3
        assert m["sync/direct_load"] == 1.0 and m["sync/retries"] == 0.0
        # disaggregated: received in place, each bucket into its TP rank's memory
        assert m.get("sync/in_place", 1.0) == 1.0
        # each TP rank got its slice: about half the model's bytes
        assert 0.45 <= m["sync/bytes_per_tp_rank"] / run["model_bytes"] <= 0.55


@pytest.mark.integration
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_a_sync_that_missed_a_tp_rank_stops_the_run(runs, placement):
    stopped = runs[placement]["stopped"]
    where = "rollout engine 0" if placement == "disaggregated" else "rank 0"
    assert stopped is not None and where in stopped, stopped


@pytest.mark.integration
def test_colocated_one_engine_spans_both_workers_each_writing_its_rank(runs):
    run = runs["colocated"]
    assert run["engines"] == 1
    binding, affinity, spin = run["cores"]
    assert binding == "0|1" and affinity == [[0], [1]]  # TP rank r on worker r's core
    assert spin == [0.05, 0.05]  # and sleeps soon after the engine's calls stop
    for m in run["metrics"]:  # the TP ranks received the model once between them (the norms
        # twice): each trainer rank wrote its ZeRO-3 shard, no gather
        assert m["sync/shared_weights"] == 1.0 and m["sync/exact_ranges"] == 0.0
        assert 1.0 <= m["sync/bytes"] / run["model_bytes"] <= 1.01


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run_main(sys.argv[2])
    else:
        engines_main(sys.argv[1])
