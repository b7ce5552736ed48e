"""Running steps: the controller (generate -> score -> advantages -> update -> sync), the
async pipeline, placements of Ray actors and the workers, checkpoints, evaluation, reward
scoring. May import rl.config, rl.errors, rl.algo, rl.data, rl.observe and the engine packages
(rollout/, update/, weight_sync/, rewards/, envs/)."""
