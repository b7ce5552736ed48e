"""The planner: each device's memory and a step's time, from the model's config.json, the recipe
and the hardware; pure arithmetic (no torch, vLLM, DeepSpeed or Ray). Imports rl.schema,
rl.config and the engine packages' config modules only; rl.cli and rl.preflight use it."""
