"""The maths between rollout and update: advantage estimators (a registry keyed by the
recipe's name) and the batch layout (samples, collation, rank splits). Imports rl.config only."""
