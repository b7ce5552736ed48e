"""Both transports on a small module: the local one in-process, the broadcast one over a real
gloo group (two ranks in two threads of this process): bytes arrive intact, tied heads are
delivered, a flipped byte or a wrong version is an error, and the sender never hangs."""
import threading

import pytest
import torch

from rl.run.role import rendezvous_port
from tests.faults import corrupt_next_send
from weight_sync.collective import CollectiveGroup
from weight_sync.buckets import tied_head_alias
from weight_sync.transport import BroadcastTransport, LocalTransport, WeightSyncError


class Config:
    tie_word_embeddings = True


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = Config()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(50, 8)
        self.model.norm = torch.nn.LayerNorm(8)
        self.model.proj = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def broadcast(module, send_version, expect_version, corrupt_bucket=None, bucket_bytes=256):
    """Run one send and one receive concurrently; returns (received dict, receive error)."""
    port, got, errors = rendezvous_port(), {}, []

    def engine():
        group = CollectiveGroup("127.0.0.1", port, 1, 2, "cpu", timeout_s=30)

        def load(weights):
            for name, t in weights:
                got[name] = t.clone()
        try:
            BroadcastTransport(group, 0).receive(load, expect_version)
        except WeightSyncError as e:
            errors.append(e)

    thread = threading.Thread(target=engine)
    thread.start()
    group = CollectiveGroup("127.0.0.1", port, 0, 2, "cpu", timeout_s=30)
    if corrupt_bucket is not None:
        corrupt_next_send(corrupt_bucket)
    stats = BroadcastTransport(group, bucket_bytes).send(module, send_version)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the receiver hung"
    return got, errors, stats


def test_broadcast_delivers_every_tensor_bit_exact_with_the_tied_head():
    m = TinyLM()
    got, errors, stats = broadcast(m, 4, 4)
    assert not errors
    assert stats.num_buckets > 1 and stats.max_bucket_bytes <= 50 * 8 * 4  # the embedding alone
    expected = dict(m.named_parameters())
    assert set(got) == set(expected) | {"lm_head.weight"}
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t.detach())
    assert torch.equal(got["lm_head.weight"], m.model.embed_tokens.weight.detach())


def test_a_flipped_byte_is_reported_with_the_bucket_and_its_tensors():
    m = TinyLM()
    got, errors, _ = broadcast(m, 1, 1, corrupt_bucket=1)
    assert len(errors) == 1
    msg = str(errors[0])
    assert "bucket 1/" in msg and "sum64 check" in msg and "marked stale" in msg
    assert "model.norm.weight" in msg or "model.proj" in msg  # names what was hit


def test_a_version_mismatch_is_an_error_and_nothing_is_loaded():
    got, errors, _ = broadcast(TinyLM(), 5, 6)
    assert not got
    assert "sent policy version 5" in str(errors[0]) and "expect 6" in str(errors[0])


def test_local_transport_needs_the_same_version_on_both_sides():
    m = TinyLM()
    t = LocalTransport(bucket_bytes=256)
    t.send(m, 2)
    with pytest.raises(WeightSyncError, match="offered 2"):
        t.receive(lambda w: None, 3)
    t.send(m, 3)
    got = {}
    stats = t.receive(lambda w: got.update(w), 3)
    assert "lm_head.weight" in got and stats.num_buckets > 1


def test_untied_models_have_no_alias():
    m = TinyLM()
    m.config.tie_word_embeddings = False
    assert tied_head_alias(m) == {}
