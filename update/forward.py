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
reference model, the old-logprob pass and the critic use it too. (verl's "prefix grouper" is the
same idea.)

Under gradient checkpointing each decoder layer reruns in the backward: the prompt's layer
writes its keys and values once (`PromptKV`: a rerun's write keeps the first), and a response
layer reads them without writing (`ResponseKV`), so that the rerun sees what the forward saw and
the cache is not a second copy of the activations.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from update.config import TrainerConfig

# Largest |shared-prompt - full| logprob of the start-up check (float32) for the shared layout
# to be used: measured 0-2.5e-5 on Qwen2/Llama; a forward that mishandles the cache is off by
# whole nats.
SHARED_PROMPT_TOLERANCE = 1e-4


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log p(targets[b, t]) under logits[b, t] / temperature: [B, T, V] logits, [B, T] ids ->
    [B, T] (TokenLogprob: the same numbers as autograd's, without its copies of the logits)."""
    return TokenLogprob.apply(logits, targets, float(temperature))


class TokenLogprob(torch.autograd.Function):
    """z[target] - logsumexp(z), z = logits / temperature in float32. Autograd keeps the scaled
    float32 logits for logsumexp's backward, and its backward makes the exponentials, the
    gather's scatter and their sum, each [B, T, V]: beside a micro-batch's activations these
    were the trainer's largest tensors (SmolLM2's vocabulary of 49,152: 192 MiB each for 16 x 64
    tokens). This keeps the logits it is given and lse, and its backward writes one tensor in
    place: the gradient, -g · softmax(z) + g at the target, over the temperature."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        lp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return lp

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        t = ctx.temperature
        z = logits.float()  # a copy unless float32: the in-place steps below must not touch
        z = z / t if t != 1.0 else (z.clone() if z is logits else z)  # the saved logits
        g = grad.unsqueeze(-1)
        z.sub_(lse.unsqueeze(-1)).exp_().mul_(-g)  # -g · softmax
        z.scatter_add_(-1, targets.unsqueeze(-1), g)
        if t != 1.0:
            z.div_(t)
        return z.to(logits.dtype), None, None


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
    """[B, R, V] logits whose row t scores response token t (response_parts, joined)."""
    parts = response_parts(model, mb)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def response_parts(model, mb: dict) -> list[torch.Tensor]:
    """response_logits in pieces along the response axis, never joined (a join is a copy of
    the logits): the full layout one [B, R, V] (it keeps logits for the last R + 1 positions
    only: position P - 1 scores the first response token), the shared one the prompts' last
    position [B, 1, V] and the responses' [B, R - 1, V]."""
    dev = next(model.parameters()).device
    if not is_shared(mb):
        out = model(input_ids=mb["input_ids"].to(dev), attention_mask=mb["attention_mask"].to(dev),
                    position_ids=mb["position_ids"].to(dev),
                    logits_to_keep=kept_positions(mb["input_ids"].shape[1],
                                                  mb["response_mask"].shape[1] + 1, dev),
                    use_cache=False)
        return [out.logits[:, :-1]]
    return _shared_prompt_logits(model, mb, dev)


def kept_positions(length: int, keep: int, dev) -> torch.Tensor:
    """logits_to_keep for the last `keep` of `length` positions, as indices rather than a count:
    the model then gathers those hidden states into a contiguous [B, keep, H], and the head is
    one matrix product whatever its weight. torch's linear folds the strided slice a count
    makes into one product (a copy) when the weight needs a gradient, but sends it to a batched
    product when it does not (ZeRO-3's gathered copy in the old-logprob pass, a frozen
    reference), which may round otherwise (MKL's SSE4.2 code does): the old-logprob pass must
    equal the training forward bit for bit."""
    return torch.arange(length - keep, length, device=dev)


def part_logprobs(parts: list[torch.Tensor], targets: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """[B, R] token_logprobs of response_parts' pieces against the [B, R] targets."""
    out, start = [], 0
    for part in parts:
        width = part.shape[1]
        out.append(token_logprobs(part, targets[:, start:start + width].to(part.device),
                                  temperature))
        start += width
    return out[0] if len(out) == 1 else torch.cat(out, 1)


class PromptKV(DynamicLayer):
    """A layer's cache in the prompts' pass: keeps the first keys and values written; a
    recompute writes the same numbers again, and gets them back without a second copy."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class ResponseKV(DynamicLayer):
    """A layer's cache in the responses' pass: each sample's prompt's keys and values (rows
    `index` of `prompt`: index_select, so the backward sums into the prompt) before its own;
    nothing is stored, so the pass and its recompute read alike."""

    def __init__(self, prompt: PromptKV, index: torch.Tensor):
        super().__init__()
        self.prompt, self.index = prompt, index
        self.keys, self.is_initialized = prompt.keys, True  # get_seq_length: the prompt's

    def update(self, key_states, value_states, *args, **kwargs):
        return (torch.cat([self.prompt.keys[self.index], key_states], -2),
                torch.cat([self.prompt.values[self.index], value_states], -2))


def allow_recompute_with_cache(model: torch.nn.Module) -> None:
    """Let checkpointed decoder layers take the shared-prompt caches (transformers drops a
    cache under checkpointing unless a layer says it only reads it; PromptKV and ResponseKV
    make a rerun's writes harmless)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._can_checkpoint_with_cache = True


def _shared_prompt_logits(model, mb: dict, dev) -> list[torch.Tensor]:
    from transformers.cache_utils import Cache

    prompt_mask = mb["prompt_attention_mask"].to(dev)
    index = mb["prompt_index"].to(dev)
    cache = Cache(layer_class_to_replicate=PromptKV)
    out = model(input_ids=mb["prompt_ids"].to(dev), attention_mask=prompt_mask,
                position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
                logits_to_keep=kept_positions(prompt_mask.shape[1], 1, dev),
                past_key_values=cache, use_cache=True)
    first = out.logits[index]  # [B, 1, V]: the prompt's last position scores token 0
    responses = mb["response_ids"].to(dev)
    r = responses.shape[1]
    if r == 1:
        return [first]
    shared = Cache(layers=[ResponseKV(layer, index) for layer in cache.layers])
    inputs = responses[:, :-1]  # the last response token scores nothing
    attention = torch.cat([prompt_mask[index],
                           mb["response_attention_mask"][:, :-1].to(dev).long()], 1)
    start = prompt_mask.sum(-1)[index]  # positions count real tokens only, as the engine does
    positions = start[:, None] + torch.arange(r - 1, device=dev)[None, :]
    rest = model(input_ids=inputs, attention_mask=attention, position_ids=positions,
                 past_key_values=shared, use_cache=True).logits  # [B, R - 1, V]
    return [first, rest]


def shares_prompts(cfg: TrainerConfig, config, recompute: bool) -> bool:
    """Whether shared-prompt micro-batches run as such (else they are expanded to the full
    layout): on when configured and a small float32 model of this architecture scores a
    made-up batch alike both ways, under recompute its gradients too
    (check_model_class; every rank decides alike, from the same config)."""
    import logging

    if not cfg.enable_prompt_sharing:
        return False
    diff, error = check_model_class(config, recompute)
    if diff <= SHARED_PROMPT_TOLERANCE:
        return True
    logging.getLogger(__name__).warning(
        "trainer.enable_prompt_sharing: %s scores shared prompts %s, so each sample runs "
        "its own prompt (slower when n > 1)", config.model_type,
        f"with an error ({error})" if error else f"off by {diff:.3g}")
    return False


def check_model_class(config, recompute: bool = False) -> tuple[float, str]:
    """check_shared_prompts on a small float32 model of the same architecture (2 layers, a
    1024-token vocabulary, random weights, no dropout): whether the model class takes the shared
    layout is a property of its code, and float32 tells a mistake from bf16's rounding (the two
    layouts' batch shapes round differently in bf16: 0.15 nats on SmolLM2). The process's
    random state is left as it was."""
    import copy

    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    small.num_hidden_layers = min(2, config.num_hidden_layers)
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:small.num_hidden_layers]
    small.vocab_size = min(1024, config.vocab_size)
    for key, value in vars(small).items():  # a train-mode check (recompute) draws no masks
        if "dropout" in key and isinstance(value, float):
            setattr(small, key, 0.0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
            return float("inf"), f"a small {config.model_type} model could not be built: {e}"
    return check_shared_prompts(model, small.vocab_size, recompute)


def check_shared_prompts(model, vocab_size: int, recompute: bool = False) -> tuple[float, str]:
    """(max |shared - full| logprob, "") on a small made-up batch (2 prompts x 2 responses of
    different lengths); (inf, the error) when the model's forward cannot take the shared
    layout (e.g. a cache class of its own). With `recompute`, under gradient checkpointing in
    train mode, and the larger of that and the gradients' largest difference relative to
    their largest magnitude (a rerun that saw another cache shows there)."""
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
    if recompute:
        model.gradient_checkpointing_enable()
        allow_recompute_with_cache(model)
        model.train()
    try:
        a, grads_a = _score(model, shared, recompute)
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
        return float("inf"), f"{type(e).__name__}: {e}".splitlines()[0]
    b, grads_b = _score(model, full_layout(shared), recompute)
    mask = shared["response_mask"].to(a.device)
    diff = float(((a - b).abs() * mask).max())
    if recompute:
        scale = max(float(g.abs().max()) for g in grads_b)
        diff = max(diff, max(float((x - y).abs().max()) for x, y in zip(grads_a, grads_b)) / scale)
    return diff, ""


def _score(model, mb: dict, backward: bool) -> tuple[torch.Tensor, list]:
    """(token logprobs, and with `backward` the gradients of their masked sum)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.set_grad_enabled(backward):
        lp = part_logprobs(response_parts(model, mb), response_targets(mb))
        if not backward:
            return lp, []
        grads = torch.autograd.grad((lp * mb["response_mask"].to(lp.device)).sum(), params)
    return lp.detach(), list(grads)
