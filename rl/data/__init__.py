"""Data and tasks: prompt sets and their rows, built-in tasks, model presets and the local
model cache, the SFT warm-up. May import rl.config, rl.errors, rl.algo, rl.observe and envs/
(multi-turn prompts and scripted warm-up turns)."""
