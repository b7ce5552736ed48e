"""The asynchronous pipeline on the real stack (disaggregated as in quickstart_fully_async: two
ZeRO-3 trainer ranks, one vLLM engine streaming in a loop of its own, Ray): the staleness bound
under a slow trainer, a sequence interrupted by a sync carrying tokens of two versions each with
its own behavior logprob, and a corrupted sync that stops generation until a sync repairs it."""
import time
from pathlib import Path

import pytest

from rl.algo.batch import Sample, collate
from rl.config import load_config
from rl.run.controller import Controller
from tests.faults import corrupt_next_send_on_actor

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
OVERRIDES = ["warmup.sft_steps=0", "rollout.prompts_per_step=8", "rollout.n=4",
             "trainer.micro_batch_size=32", "ray.num_cpus_per_worker=0.5",
             "ray.num_cpus_per_rollout_worker=0.5", "run.timeline_steps=0"]
LONG = 200  # tokens of the sequences the tests cut (the tiny model rarely stops early)


def controller_for(placements, tmp, name: str, *extra: str) -> Controller:
    cfg = load_config(str(ROOT / "recipes" / "quickstart_fully_async.yaml"), OVERRIDES + [
        f"run.output_dir={tmp}", f"run.name={name}", *extra])
    c = Controller(cfg, placements=placements)
    c.setup()
    return c


# first: it takes the placement the module's async run then keeps for its tests
def test_one_step_trains_every_batch_one_version_old(placements, tmp_path):
    c = controller_for(placements, tmp_path, "one_step", "pipeline.mode=one_step",
                       "rollout.max_new_tokens=8")
    try:
        metrics = [c.step(k) for k in range(1, 4)]
    finally:
        c.life.shutdown()
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [m["rollout/policy_version"] for m in metrics] == [0.0, 0.0, 1.0]
    assert all(m["sync/logprob_max_abs_diff"] < 1e-3 for m in metrics)


@pytest.mark.parametrize("mode", ["adapters", "merged"])
def test_lora_streams_one_step_behind(placements, tmp_path, mode):
    """LoRA on the same placement: each sync moves the adapter alone (adapters: into the
    streaming engine's vLLM LoRA) or the merged model (broadcast buckets), the engine paused,
    checked on the probe and resumed, and the batches stay one version old."""
    c = controller_for(placements, tmp_path, f"lora_{mode}", "pipeline.mode=one_step",
                       "rollout.max_new_tokens=8", "trainer.lora.rank=4", "trainer.lr=0.01",
                       f"sync.lora={mode}")
    try:
        metrics = [c.step(k) for k in range(1, 4)]
    finally:
        c.life.shutdown()
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(m["sync/logprob_max_abs_diff"] < 1e-3 for m in metrics)
    sizes = [m["sync/bytes"] for m in metrics]
    full = 1_970_688  # the tiny model's float32 bytes
    assert all(0 < b < 0.1 * full for b in sizes) if mode == "adapters" else sizes == [full] * 3


@pytest.fixture(scope="module")
def async_run(placements, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    c = controller_for(placements, tmp, "fully_async", "pipeline.max_staleness=1",
                       f"rollout.max_new_tokens={LONG}", "rollout.max_model_len=512")
    yield c
    c.life.shutdown()


def quiesce(c: Controller) -> None:
    """Let the producer's work finish and its collect calls return: the engine is then ours."""
    import ray

    while c.producer.in_flight:
        c.producer._poll(c.policy_version)
    ray.get(list(c.producer.collects))
    c.producer.collects.clear()


def test_a_slow_trainer_never_trains_beyond_max_staleness(async_run, monkeypatch):
    """Each update waits, on top of its work, until the engine has run out of work (the batch
    the bound allows is done, however slow the machine), then 0.5 s more: the producer runs
    ahead up to the bound (staleness 1 from step 2 on) and then waits: nothing is generated
    that would have to be dropped."""
    import ray

    c = async_run
    update = c.update
    trained = []

    def slow_update(samples, step):
        trained.append((c.policy_version, [s.policy_version for s in samples]))
        deadline = time.time() + 120  # an engine that never idles breaks the bound: asserted
        while not ray.get(c.engines[0].stream_status.remote())["idle"] and \
                time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        return update(samples, step)

    monkeypatch.setattr(c, "update", slow_update)
    metrics = [c.step(k) for k in range(1, 5)]
    for u, versions in trained:
        assert all(0 <= u - v <= 1 for v in versions), (u, versions)
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["pipeline/dropped_stale"] == 0.0 for m in metrics)
    # waiting, not over-producing: at most one batch ahead while the trainer is busy
    assert c.producer.unconsumed <= c.cfg.rollout.prompts_per_step
    # the engine waited for the bound (at least the 0.5 s of each of the 3 updates before)
    assert sum(m["time/rollout_wait"] for m in metrics[1:]) > 1.0, metrics


def generate_then_train(c: Controller, key, tokens_in: int):
    """The engine (ours alone after `quiesce`) starts a long group, which gets ~tokens_in tokens
    under version v and is paused there, as the next sync pauses it (cutting the sequences in
    flight; paused now, not when the sync comes, so that a slow machine cannot finish them
    first); then one supervised step moves the trainer's weights past v. Returns
    (engine, prompt, v)."""
    import ray

    quiesce(c)
    engine, prompt = c.engines[0], c.prompts.prompt_ids[0]
    start = ray.get(engine.stream_status.remote())["steps"]
    ray.get(engine.submit.remote([key], [prompt], [12345]))
    wait_for_steps(engine, start + tokens_in)
    ray.get(engine.pause_for_sync.remote())
    sft_step(c, prompt)
    return engine, prompt, c.policy_version


def trainer_diffs(c: Controller, prompt: list[int], comp: dict, version: int) -> list[float]:
    """|behavior logprob - the trainer's now| of the completion's tokens of `version`."""
    import ray

    # a collective under ZeRO-3: every trainer rank scores it
    trainer = ray.get([t.trainer_logprobs.remote(prompt + comp["token_ids"])
                       for t in c.trainers])[0]
    own = trainer[len(prompt) - 1:]  # token by token
    return [abs(a - b) for a, b, ver in zip(comp["logprobs"], own, comp["versions"])
            if ver == version]


def wait_for_steps(engine, at_least: int) -> int:
    import ray

    deadline = time.time() + 120
    while (steps := ray.get(engine.stream_status.remote())["steps"]) < at_least:
        assert time.time() < deadline
        time.sleep(0.01)
    return steps


def collect_group(engine, key):
    import ray

    deadline = time.time() + 300
    while time.time() < deadline:
        for g in ray.get(engine.collect.remote(5.0))["groups"]:
            if g["key"] == key:
                return g
    raise AssertionError(f"group {key} never finished")


def sft_step(c: Controller, prompt: list[int]) -> None:
    """One supervised step on the trainer: its weights now differ from the engine's."""
    import ray

    s = Sample(0, 0, prompt, [7, 8, 9, 10], [0.0] * 4, "stop", "")
    ray.get([w.sft.remote([collate([s], c.tokenizer.pad_token_id)], 4.0) for w in c.trainers])


def test_an_interrupted_sequence_keeps_each_tokens_version_and_behavior_logprob(async_run):
    c = async_run
    key = ("cut", 0, 0)
    engine, prompt, v = generate_then_train(c, key, 20)  # the trainer moves on to v + 1
    c.sync()  # interrupts the sequences in flight
    result = collect_group(engine, key)
    cut = 0
    for comp in result["completions"]:
        versions, lps = comp["versions"], comp["logprobs"]
        assert len(comp["token_ids"]) == len(versions) == len(lps)
        assert versions[0] == v and set(versions) <= {v, v + 1}
        if set(versions) == {v, v + 1}:
            cut += 1
            first = versions.index(v + 1)
            assert versions == [v] * first + [v + 1] * (len(versions) - first)
        if comp is result["completions"][0]:  # against the trainer at v + 1
            new, old = trainer_diffs(c, prompt, comp, v + 1), trainer_diffs(c, prompt, comp, v)
            assert new and max(new) < 1e-3  # tokens of v + 1: v + 1's logprobs
            assert old and max(old) > 1e-3  # tokens of v: still v's, not recomputed
            # the trainer gets each token's own behavior logprob
            s = Sample(0, 0, prompt, comp["token_ids"], lps, comp["finish_reason"], "")
            batch = collate([s], c.tokenizer.pad_token_id)
            assert batch["rollout_logprobs"][0, :len(lps)].tolist() == pytest.approx(lps)
    assert cut >= 2, "the sync cut no sequence"


def test_a_corrupted_sync_stops_generation_until_a_sync_repairs_it(async_run):
    import ray

    from weight_sync.transport import WeightSyncError

    c = async_run
    key = ("corrupt", 0, 0)
    engine, prompt, v = generate_then_train(c, key, 10)
    ray.get(c.placement.trainers[0].__ray_call__.remote(corrupt_next_send_on_actor, 0))
    with pytest.raises(WeightSyncError):
        c.placement.sync(v + 1, c.life.probe)
    frozen = ray.get(engine.stream_status.remote())
    time.sleep(1.0)
    assert frozen["paused"] and ray.get(engine.stream_status.remote()) == frozen
    c.sync()  # repairs: v + 1 again, checked, and generation resumes
    assert c.policy_version == v + 1
    comp = collect_group(engine, key)["completions"][0]
    after = trainer_diffs(c, prompt, comp, v + 1)
    assert after and max(after) < 1e-3  # no token came from the corrupted weights
