"""The placement's shape: what its actors are started with."""
from rl.config import load_config


def test_the_shape_is_what_the_actors_are_started_with():
    """Runs of one shape can share actors; anything set per run (model, lr, rollout) does not
    change it, and what the actors are started with (count, resources, cores, concurrency)
    does."""
    from rl.run.reserve import placement_shape

    base = placement_shape(load_config(None))
    assert placement_shape(load_config(None, ["trainer.lr=0.1", "rollout.n=4",
                                              "model.path=builtin:tiny-llama-tied"])) == base
    for other in (["ray.num_workers=1"], ["ray.num_cpus_per_worker=0.5"],
                  ["placement=disaggregated"], ["ray.trainer_resources={a: 1}"]):
        assert placement_shape(load_config(None, other)) != base, other
    sync = placement_shape(load_config(None, ["placement=disaggregated"]))
    for other in (["pipeline.mode=one_step"], ["ray.split_cores=true"],
                  ["ray.num_rollout_workers=1"], ["sync.timeout_s=5"]):
        assert placement_shape(load_config(None, ["placement=disaggregated", *other])) != sync
