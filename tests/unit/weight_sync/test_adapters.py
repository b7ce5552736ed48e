"""weight_sync.adapters: the adapter checksum sees any changed byte and does not depend on the
order tensors come in."""
import torch

from weight_sync.adapters import adapter_dir, checksum


def test_checksum_sees_a_changed_element_and_ignores_order():
    gen = torch.Generator().manual_seed(0)
    tensors = {"b.lora_B.default.weight": torch.randn(5, 3, generator=gen),
               "a.lora_A.default.weight": torch.randn(3, 7, generator=gen)}  # 36 floats: padded
    first = checksum(tensors, "sum64")
    assert checksum(dict(reversed(list(tensors.items()))), "sum64") == first
    changed = {k: v.clone() for k, v in tensors.items()}
    changed["a.lora_A.default.weight"][2, 6] += 1e-3
    assert checksum(changed, "sum64") != first
    assert checksum(changed, "crc32") != checksum(tensors, "crc32")


def test_adapter_dir_is_per_process_and_version():
    assert adapter_dir(3).name == "v3" and adapter_dir(3).parent == adapter_dir(4).parent
