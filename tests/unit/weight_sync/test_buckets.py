"""Bucket planning and the (unsharded) weight iterator, including the tied-head rule."""
import torch

from weight_sync.buckets import SyncStats, iter_full_weights, plan_buckets


def test_plan_buckets_bounds_bucket_size_and_keeps_order():
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([10, 10, 30, 5])]
    buckets = plan_buckets(params, bucket_bytes=80)  # 20 floats per bucket
    assert [[n for n, _ in b] for b in buckets] == [["p0", "p1"], ["p2"], ["p3"]]


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(4, 3)
        self.lm_head = torch.nn.Linear(3, 4, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def test_tied_head_is_sent_explicitly():
    stats = SyncStats()
    out = dict(iter_full_weights(Tied(), bucket_bytes=1 << 20,
                                 aliases={"lm_head.weight": "embed_tokens.weight"}, stats=stats))
    assert set(out) == {"embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(out["lm_head.weight"], out["embed_tokens.weight"])
    assert stats.num_tensors == 1 and stats.bytes == 4 * 3 * 4


def test_yielded_tensors_outlive_a_released_parameter():
    m = Tied()
    expected = m.embed_tokens.weight.detach().clone()
    name, t = next(iter_full_weights(m, 1 << 20, aliases={}))
    m.embed_tokens.weight.data = torch.empty(0)  # how ZeRO-3 releases a gathered parameter
    assert torch.equal(t, expected)  # the consumer's reference keeps the gathered values
