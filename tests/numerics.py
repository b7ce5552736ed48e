"""Tolerances from the arithmetic: each rule once, with its reason (docs/tests.md, "Tolerances").

Where both sides run the same kernels in the same order, tests compare bit for bit (a resume, the
exact sync check, the bytes a sync moves): no rule here. Elsewhere two computations of one value
round differently (another CPU class's vector width, ZeRO-3's partitioned reductions, vLLM's
kernels against torch's, the shared-prompt layout against the full one), and the rules below
bound how far apart rounding alone puts them, from:
- u, the dtype's unit roundoff (float32 2^-24, bfloat16 2^-8);
- the magnitude of the values compared (what a value sums is of its order);
- the depth: the layers a value passes through (the head counted), once more for each optimizer
  step behind it (its weights carry that step's rounding into the next forward);
- the width: the longest reduction in a layer (the model's hidden or intermediate size).
"""
from __future__ import annotations

import math

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}


def depth(config, steps: int = 0) -> int:
    """Layers a forward chains (the decoder layers and the head), once more for each optimizer
    step behind the weights."""
    return (config.num_hidden_layers + 1) * (steps + 1)


def width(config) -> int:
    """The longest reduction in a layer: the MLP's down projection or the hidden size."""
    return max(config.hidden_size, config.intermediate_size)


def rounding(magnitude: float, depth: int, width: int, dtype: str = "float32") -> float:
    """Two computations of one value through `depth` layers of reductions of at most `width` terms
    of about `magnitude`: independent roundings add like a random walk, so a reduction is within
    about √width·u of its terms' magnitude (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019);
    the layers' errors add up (first order), and each side carries its own (2x)."""
    return 2 * depth * math.sqrt(width) * UNIT_ROUNDOFF[dtype] * magnitude


def adam_update(depth: int, width: int, dtype: str = "float32") -> float:
    """Relative L2 distance between two Adam updates (the weights' change from the same start)
    whose gradients differ by rounding, ρ = rounding(1, depth, width) relative to what each
    gradient sums. Adam's step lr·m/(√v + ε) does not shrink with the gradient: a coordinate
    whose gradient sums to within ρ of zero can move by up to 2·lr however small ρ is, so a max
    over weights bounds nothing; one whose gradient is y of its terms' sum moves by ~2·lr·ρ/y.
    With y spread evenly near 0, the change's mean square is at most ~8ρ·lr² against a step's
    ~lr²: √(8ρ)."""
    return math.sqrt(8 * rounding(1.0, depth, width, dtype))


def model_rounding(model_dir, values) -> float:
    """rounding() for two computations of `values` (floats) by the model in model_dir (its
    config.json gives the depth and width)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return rounding(max(abs(x) for x in values), depth(config), width(config))
