"""update.forward.token_logprobs: autograd's numbers (forward and gradient, any temperature and
dtype) without autograd's float32 copies of the logits."""
import pytest
import torch

from update.forward import part_logprobs, token_logprobs


def reference(logits, targets, temperature):
    z = logits.float() / temperature
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_autograds_values_and_gradients_bit_for_bit(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)
    ours = token_logprobs(logits, targets, temperature)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    theirs = reference(logits, targets, temperature)
    (grad_theirs,) = torch.autograd.grad((theirs * weights).sum(), logits)
    assert torch.equal(ours, theirs)
    # the same operations on the same numbers: -g·exp(z - lse), plus g at the target, over T
    assert torch.equal(grad_ours, grad_theirs)


def test_token_logprobs_gradcheck_in_float64_and_bf16_logits_get_a_bf16_gradient():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), generator=gen)
    # float64 in, float32 inside (the policy's logprobs are float32 whatever the model's dtype)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.9).double(),
                                    (logits,), eps=1e-3, atol=1e-4, rtol=1e-3)
    half = logits.detach().bfloat16().requires_grad_()
    token_logprobs(half, targets).sum().backward()
    assert half.grad.dtype == torch.bfloat16


def test_token_logprobs_keeps_no_copy_of_the_logits_for_its_backward():
    """What the graph keeps beyond the logits themselves is [B, T]-sized (autograd's formula
    keeps the float32 logits over T, a [B, T, V] copy)."""
    logits = torch.randn(4, 6, 1000, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 6))
    kept = []

    def pack(t):
        if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            kept.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits, targets, 0.8)
    assert sum(kept) <= 2 * 4 * 6, kept


def test_part_logprobs_scores_each_piece_against_its_own_targets():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 9, generator=gen)
    targets = torch.randint(0, 9, (2, 5), generator=gen)
    whole = token_logprobs(logits, targets)
    assert torch.equal(part_logprobs([logits[:, :1], logits[:, 1:]], targets), whole)


def _matrix_products(fn) -> list[tuple]:
    """(op, output shape) of every matrix product `fn` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm"):
                self.ops.append((func.overloadpacket.__name__, tuple(out.shape)))
            return out

    with Record() as record:
        fn()
    return record.ops


@pytest.mark.parametrize("share_prompts", [False, True])
def test_the_old_logprob_pass_and_the_training_forward_run_the_same_matrix_products(share_prompts):
    """With weights that need no gradient (the old-logprob pass on ZeRO-3's gathered copy, a
    frozen reference) torch's linear sent the head's strided slice of the hidden states to a
    batched product (bmm) where the training forward folds it into one (mm): on MKL's SSE4.2
    code the two rounded otherwise and the one-pass update no longer equalled the two-pass one
    (update.forward.kept_positions)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl.algo.batch import Sample, collate
    from update.forward import response_parts

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         vocab_size=100, tie_word_embeddings=False))
    # 4 samples, 2 groups: shared, each group's prompt runs once
    mb = collate([Sample(i, i // 2, list(range(5, 9 + i // 2)), list(range(20, 23 + i)), [],
                         "stop", "") for i in range(4)], 0, share_prompts=share_prompts)
    trained = _matrix_products(lambda: response_parts(model, mb))
    model.requires_grad_(False)  # as ZeRO-3's gathered copy (update.zero.scoring) and a reference
    with torch.no_grad():
        scored = _matrix_products(lambda: response_parts(model, mb))
    assert scored == trained
    # the head in one product: [B * (R + 1), V]; shared, the prompts' last positions [G, V]
    assert ("mm", (2, 100) if share_prompts else (4 * 7, 100)) in trained
