"""The exact post-sync check: every trainer rank's digests of its part of each tensor, cast to the
engine's dtype, equal the engine's digests of the same bytes after a direct load; one changed
element (one bf16 step) anywhere, a tied head the engine keeps apart, is named."""
from types import SimpleNamespace

import pytest
import torch

from tests.unit.weight_sync.test_in_place import SPEC, engine_params, hf_tensors
from tests.unit.weight_sync.test_shard_gather import module_with
from weight_sync.direct import DirectLoad
from weight_sync.exact import ExactCheckError, compare, engine_digests, trainer_digests
from weight_sync.in_place import EngineLayout


def trainer_module(tensors: dict[str, torch.Tensor], tied: bool) -> torch.nn.Module:
    """A module whose named_parameters are `tensors` (HF names), whole on every rank."""
    root = module_with({n: torch.nn.Parameter(t.clone()) for n, t in tensors.items()})
    root.config = SimpleNamespace(tie_word_embeddings=tied)
    return root


def synced_engine(dtype, head: str):
    """(layout, engine params, trainer module), the engine loaded with the trainer's tensors.
    head: "tied" (the engine's lm_head is its embedding), "copy" (a tied trainer, an engine that
    keeps a copy of the head) or "own" (an untied model)."""
    hf, params = hf_tensors(), engine_params(dtype)
    if head != "tied":
        params["lm_head.weight"] = torch.zeros_like(params["lm_head.weight"])
    if head == "own":
        hf["lm_head.weight"] = torch.randn(100, 16, generator=torch.Generator().manual_seed(1))
    layout = EngineLayout.of(params)
    _, views = layout.pack(params)
    load = dict(hf)
    if head == "copy":
        load["lm_head.weight"] = hf["model.embed_tokens.weight"]
    DirectLoad(views, SPEC)(load.items())
    return layout, views, trainer_module(hf, tied=head != "own")


def all_ranges(layout, module, world: int):
    return [r for rank in range(world) for r in trainer_digests(layout, SPEC, module, rank, world)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", ["tied", "copy", "own"])
def test_every_rank_s_part_matches_what_the_engine_holds(world, dtype, head):
    layout, views, module = synced_engine(dtype, head)
    ranges = all_ranges(layout, module, world)
    assert compare(ranges, engine_digests(layout, views, ranges), "engine 0") == len(ranges)
    sent = sum(r.nbytes for r in ranges)  # every byte but the vocab's padding rows, once
    padding = (128 - 100) * 16 * dtype.itemsize * (1 if head == "tied" else 2)
    assert sent == layout.nbytes - padding - sum(
        -(m.nbytes) % 64 for m in layout.tensors)  # alignment gaps


@pytest.mark.parametrize("head, stale, named", [
    ("own", "model.layers.0.mlp.down_proj.weight", "down_proj.weight"),
    ("own", "model.layers.0.self_attn.qkv_proj.bias", "v_proj.bias"),  # its last rows
    ("own", "lm_head.weight", "lm_head.weight"),
    ("copy", "lm_head.weight", "model.embed_tokens.weight")])  # a stale copy of a tied head
def test_one_bf16_step_in_one_tensor_is_named(head, stale, named):
    layout, views, module = synced_engine(torch.bfloat16, head)
    ranges = all_ranges(layout, module, 2)
    sent = views[stale][:100] if stale.startswith("lm_head") else views[stale]  # not padding
    last = sent.reshape(-1)[-1:]
    last.copy_(last.view(torch.int16).add(1).view(torch.bfloat16))  # one bf16 step
    with pytest.raises(ExactCheckError, match="1 of") as err:
        compare(ranges, engine_digests(layout, views, ranges), "engine 0")
    assert named in str(err.value)


def test_the_trainer_side_casts_as_the_sync_does():
    """A float32 trainer's digests are of its values rounded to bf16: equal to a bf16 engine's
    after the load, and a trainer step below bf16's resolution leaves them equal too."""
    layout, views, module = synced_engine(torch.bfloat16, "tied")
    with torch.no_grad():
        module.model.norm.weight.mul_(1 + 1e-6)
    ranges = all_ranges(layout, module, 2)
    assert compare(ranges, engine_digests(layout, views, ranges), "engine 0") == len(ranges)
