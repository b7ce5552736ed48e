"""The RL controller, its config and the `rl-train` CLI."""
