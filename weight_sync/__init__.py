"""Moving trained parameters into the rollout engine: bucketed gathering and verification."""
