"""Scoring a micro-batch's responses: one forward per sample, or one per distinct prompt.

Glossary: B samples, G distinct prompts, P longest prompt, R longest response, L = P + R, V vocab.

Two micro-batch layouts (rl.algo.batch.collate makes both):
- full: input_ids / attention_mask / position_ids [B, L], prompts left-padded and responses
  right-padded, so every response starts at column P;
- shared prompts: prompt_ids / prompt_attention_mask [G, P] (left-padded), prompt_index [B] (the
  row of each sample's prompt), response_ids [B, R] (right-padded).
Both have response_mask [B, R] and the token fields [B, R].

A GRPO batch holds n samples of every prompt. The full layout runs each prompt n times through
the model; the shared one runs it once, keeps its keys and values, and runs the n responses on
them (gradients flow back into the prompt's pass through the cache). The logits are the same
computation on the same numbers (measured equal to 0 in float32 on Qwen2/Llama, gradients to
4e-7 relative); with prompts of ~16 tokens and responses of ~4 it is 2.6x less work. The
reference model and the old-logprob pass use it too. (verl's "prefix grouper" is the same idea.)
"""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log p(targets[b, t]) under logits[b, t]: [B, T, V] logits, [B, T] ids -> [B, T]."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def is_shared(mb: dict) -> bool:
    return "prompt_index" in mb


def response_targets(mb: dict) -> torch.Tensor:
    """[B, R] the response tokens, in either layout (pads past each response's end)."""
    if is_shared(mb):
        return mb["response_ids"]
    return mb["input_ids"][:, -mb["response_mask"].shape[1]:]


def full_layout(mb: dict) -> dict:
    """The full layout of a shared-prompt micro-batch (for models that need it, e.g. the critic)."""
    if not is_shared(mb):
        return mb
    index = mb["prompt_index"]
    response_attention = mb["response_attention_mask"].long()
    attention_mask = torch.cat([mb["prompt_attention_mask"][index], response_attention], 1)
    out = {k: v for k, v in mb.items()
           if k not in ("prompt_ids", "prompt_attention_mask", "prompt_index", "response_ids")}
    out.update(input_ids=torch.cat([mb["prompt_ids"][index], mb["response_ids"]], 1),
               attention_mask=attention_mask,
               position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0))
    return out


def response_logits(model, mb: dict) -> torch.Tensor:
    """[B, R, V] logits whose row t scores response token t (the full layout keeps logits for
    the last R + 1 positions only: position P - 1 scores the first response token)."""
    dev = next(model.parameters()).device
    if not is_shared(mb):
        out = model(input_ids=mb["input_ids"].to(dev), attention_mask=mb["attention_mask"].to(dev),
                    position_ids=mb["position_ids"].to(dev),
                    logits_to_keep=mb["response_mask"].shape[1] + 1, use_cache=False)
        return out.logits[:, :-1]
    return _shared_prompt_logits(model, mb, dev)


def _shared_prompt_logits(model, mb: dict, dev) -> torch.Tensor:
    from transformers import DynamicCache

    prompt_mask = mb["prompt_attention_mask"].to(dev)
    index = mb["prompt_index"].to(dev)
    out = model(input_ids=mb["prompt_ids"].to(dev), attention_mask=prompt_mask,
                position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0), logits_to_keep=1,
                use_cache=True)
    first = out.logits[index]  # [B, 1, V]: the prompt's last position scores token 0
    responses = mb["response_ids"].to(dev)
    r = responses.shape[1]
    if r == 1:
        return first
    # every sample's copy of its prompt's keys and values (index_select: backward sums them)
    cache = DynamicCache()
    for layer, kv in enumerate(out.past_key_values.layers):
        cache.update(kv.keys[index], kv.values[index], layer)
    inputs = responses[:, :-1]  # the last response token scores nothing
    attention = torch.cat([prompt_mask[index],
                           mb["response_attention_mask"][:, :-1].to(dev).long()], 1)
    start = prompt_mask.sum(-1)[index]  # positions count real tokens only, as the engine does
    positions = start[:, None] + torch.arange(r - 1, device=dev)[None, :]
    rest = model(input_ids=inputs, attention_mask=attention, position_ids=positions,
                 past_key_values=cache, use_cache=True).logits  # [B, R - 1, V]
    return torch.cat([first, rest], 1)


def check_model_class(config) -> tuple[float, str]:
    """check_shared_prompts on a small float32 model of the same architecture (2 layers, a
    1024-token vocabulary, random weights): whether the model class takes the shared layout
    is a property of its code, and float32 tells a mistake from bf16's rounding (the two
    layouts' batch shapes round differently in bf16: 0.15 nats on SmolLM2). The process's
    random state is left as it was."""
    import copy

    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    small.num_hidden_layers = min(2, config.num_hidden_layers)
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:small.num_hidden_layers]
    small.vocab_size = min(1024, config.vocab_size)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
            return float("inf"), f"a small {config.model_type} model could not be built: {e}"
    return check_shared_prompts(model, small.vocab_size)


def check_shared_prompts(model, vocab_size: int) -> tuple[float, str]:
    """(max |shared - full| logprob, "") on a small made-up batch (2 prompts x 2 responses of
    different lengths); (inf, the error) when the model's forward cannot take the shared
    layout (e.g. a cache class of its own)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 3)]
    responses = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (4, 2, 1, 3)]
    p, r = max(map(len, prompts)), max(map(len, responses))
    shared = {"prompt_ids": torch.zeros(2, p, dtype=torch.long),
              "prompt_attention_mask": torch.zeros(2, p, dtype=torch.long),
              "prompt_index": torch.tensor([0, 0, 1, 1]),
              "response_ids": torch.zeros(4, r, dtype=torch.long),
              "response_mask": torch.zeros(4, r)}
    for g, ids in enumerate(prompts):
        shared["prompt_ids"][g, p - len(ids):] = torch.tensor(ids)
        shared["prompt_attention_mask"][g, p - len(ids):] = 1
    for i, ids in enumerate(responses):
        shared["response_ids"][i, :len(ids)] = torch.tensor(ids)
        shared["response_mask"][i, :len(ids)] = 1.0
    shared["response_attention_mask"] = shared["response_mask"].clone()
    full = full_layout(shared)
    with torch.no_grad():
        try:
            a = token_logprobs(response_logits(model, shared), shared["response_ids"].to(
                next(model.parameters()).device))
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
            return float("inf"), f"{type(e).__name__}: {e}".splitlines()[0]
        b = token_logprobs(response_logits(model, full), response_targets(full).to(a.device))
    mask = shared["response_mask"].to(a.device)
    return float(((a - b).abs() * mask).max()), ""
