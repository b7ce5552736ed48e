"""The install leaves vLLM and transformers importable side by side (no CUDA torchvision)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"


def test_vllm_and_transformers_import_together():
    code = ("import vllm; from transformers import AutoModelForCausalLM, Qwen2ForCausalLM, "
            "LlamaForCausalLM; import deepspeed, ray; print(vllm.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
