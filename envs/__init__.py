"""Environments of multi-turn rollouts: a trajectory's turns between model outputs (tool calls
answered, an environment stepped). May import rewards/ (the code sandbox); never rl/,
rollout/, update/ or weight_sync/."""
